"""``python manage.py runagents``: a disposable worker that advances durable agent runs."""

from __future__ import annotations

import datetime
import gc
import logging
import sys
from typing import Any

from django.conf import settings
from django.core.management.base import (
    BaseCommand,
    CommandError,
    CommandParser,
    SystemCheckError,
)
from django.db import DEFAULT_DB_ALIAS, DatabaseError, connections
from django.utils import timezone

from durable_agents._internal import db
from durable_agents._internal.migration_state import unapplied_migrations
from durable_agents.checks import OFFLINE_WITHOUT_DEBUG, PROMPT_DRIFT, worker_checks
from durable_agents.conf import app_settings
from durable_agents.declare.agents import registry
from durable_agents.engine.inflight import prompt_drift, runs_held_by_others
from durable_agents.engine.worker import Worker
from durable_agents.exceptions import InvalidArgument, NotMigrated, WorkerIdInUse
from durable_agents.observe import prometheus

logger = logging.getLogger("durable_agents.worker")

# Every interface: a scraper reaches a container or a pod on its own address, never on its
# loopback. The endpoint is read-only and shows counts, never a run's content; on a host with
# a public interface pass --metrics-addr 127.0.0.1 (or the private address) or firewall it.
DEFAULT_METRICS_ADDR = "0.0.0.0"


class Command(BaseCommand):
    help = (
        "Claim and advance durable agent runs. SIGTERM/SIGINT release held runs and exit 0; "
        "after a SIGKILL the runs are resumed by any worker once their lease expires."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--concurrency", type=int, default=1, help="runs advanced at once")
        parser.add_argument("--burst", action="store_true", help="exit 0 once no run is claimable")
        parser.add_argument("--max-runs", type=int, default=None, help="stop after K claims")
        parser.add_argument(
            "--worker-id", default=None, help="lease owner name (default: host:pid:random)"
        )
        parser.add_argument(
            "--lease-seconds",
            type=float,
            default=None,
            help="how long a claim lasts without renewal; after a SIGKILL its runs wait this "
            "long (default: the LEASE_SECONDS setting)",
        )
        parser.add_argument(
            "--poll-interval",
            type=float,
            default=None,
            help="seconds an idle slot waits between claim attempts (default: the "
            "POLL_INTERVAL setting)",
        )
        parser.add_argument(
            "--grace-seconds",
            type=float,
            default=None,
            help="after SIGTERM, how long steps in flight may take to commit (default: the "
            "SHUTDOWN_GRACE_SECONDS setting); 0 abandons them at once",
        )
        parser.add_argument(
            "--allow-offline",
            action="store_true",
            help="start even though OFFLINE is on and DEBUG is off (the offline model then "
            f"runs the tool calls written in task texts; system check {OFFLINE_WITHOUT_DEBUG})",
        )
        parser.add_argument(
            "--metrics-port",
            type=int,
            default=None,
            help="serve Prometheus metrics at http://ADDR:PORT/metrics (needs the prometheus "
            'extra: pip install "django-durable-agents[prometheus]"); 0 picks a free port',
        )
        parser.add_argument(
            "--metrics-addr",
            default=None,
            help=f"address the metrics server listens on (default {DEFAULT_METRICS_ADDR}, every "
            "interface, which scrapers of containers need; 127.0.0.1 keeps it on this host)",
        )
        parser.add_argument(
            "--no-schedules",
            action="store_true",
            help="do not fire agent schedules in this worker (the other workers do; by default "
            "every worker but a --burst one fires them, each slot starting one run)",
        )
        parser.add_argument(
            "--strict",
            action="store_true",
            help="refuse to start when a registered agent changed without a new version while "
            f"runs started with the old definition are in flight (system check {PROMPT_DRIFT}); "
            "without it the worker says so and starts",
        )

    def execute(self, *args: Any, **options: Any) -> Any:
        # BaseCommand.execute runs the system checks before handle(); remember the flag so
        # that check() below can let the one check it answers pass.
        self._allow_offline = bool(options.get("allow_offline"))
        return super().execute(*args, **options)

    def check(self, *args: Any, **kwargs: Any) -> None:
        if not getattr(self, "_allow_offline", False):
            return self._check_worker(*args, **kwargs)
        # --allow-offline is the operator's explicit answer to that one error: silence it for
        # this run through the documented mechanism, and nothing else. No thread runs yet.
        silenced = settings.SILENCED_SYSTEM_CHECKS
        settings.SILENCED_SYSTEM_CHECKS = [*silenced, OFFLINE_WITHOUT_DEBUG]
        try:
            return self._check_worker(*args, **kwargs)
        finally:
            settings.SILENCED_SYSTEM_CHECKS = silenced

    def _check_worker(self, *args: Any, **kwargs: Any) -> None:
        """Django's checks, then the worker's own (``checks.worker_checks``: an API key)."""
        super().check(*args, **kwargs)
        issues = [m for m in worker_checks.run_checks() if not m.is_silenced()]
        errors = [m for m in issues if m.is_serious()]
        for message in [m for m in issues if not m.is_serious()]:
            self.stderr.write(str(message), self.style.WARNING)
        if errors:
            raise SystemCheckError("runagents cannot start:\n" + "\n".join(str(m) for m in errors))

    def handle(self, *args: Any, **options: Any) -> None:
        metrics = _metrics_address(options["metrics_port"], options["metrics_addr"])
        _ensure_console_logging()
        self._refuse_offline_in_production(options["allow_offline"])
        _ensure_database_ready(DEFAULT_DB_ALIAS)
        _report_prompt_drift(strict=options["strict"])
        if not registry.all():
            # Not fatal (a worker may be started before the code that registers agents is
            # deployed), but it cannot advance anything: it claims only runs of the agent
            # versions it defines.
            logger.warning(
                "no agents are registered in this process: durable_agents imports the "
                "agents.py module of every app in INSTALLED_APPS at startup, and none of them "
                "defined an Agent. This worker will claim no run."
            )
        # Every thread of this process shares one small pool (PostgreSQL): a connection is
        # held only while a slot talks to the database, not for a run's whole life. The
        # heartbeat's and the listener's own connections count towards DB_POOL_SIZE too.
        db.use_pool(db.statement_pool_size(app_settings.DB_POOL_SIZE, bool(app_settings.LISTEN)))
        _raise_open_files_limit(options["concurrency"])
        _limit_malloc_arenas()
        try:
            worker = Worker(
                worker_id=options["worker_id"],
                concurrency=options["concurrency"],
                burst=options["burst"],
                max_runs=options["max_runs"],
                lease_seconds=options["lease_seconds"],
                poll_interval=options["poll_interval"],
                grace_seconds=options["grace_seconds"],
                schedules=False if options["no_schedules"] else None,
            )
            worker.register()
        except (InvalidArgument, WorkerIdInUse) as exc:
            raise CommandError(f"refusing to start: {exc}") from exc
        if metrics is not None:
            _serve_metrics(worker, *metrics)
        _tune_garbage_collector(app_settings.WORKER_GC_THRESHOLD)
        code = worker.run()
        if options["burst"]:
            _report_held_leases(worker.worker_id)
        if code:
            # A slot died of a bug: a non-zero status tells the supervisor to restart us.
            sys.exit(code)

    def _refuse_offline_in_production(self, allowed: bool) -> None:
        """The system check already stops a plain start; this also covers --skip-checks and
        call_command (which skips checks by default)."""
        if not (app_settings.OFFLINE is True and not settings.DEBUG):
            return
        if not allowed:
            raise CommandError(
                "refusing to start: DURABLE_AGENTS['OFFLINE'] is on and DEBUG is off, so the "
                "offline scripted model would run the tool calls written in task texts. Turn "
                "OFFLINE off (and set ANTHROPIC_API_KEY), or pass --allow-offline if this is "
                "deliberate."
            )
        logger.warning(
            "OFFLINE is on with DEBUG off (--allow-offline): the offline scripted model answers "
            "every model call, and the '@tool {...}' lines of a run's task text run those "
            "tools for real. Never do this where untrusted people can start runs."
        )


def _report_prompt_drift(*, strict: bool) -> None:
    """Before any claim: the agents whose definition changed under a version that runs in
    flight are pinned to. A warning by default (one agent's drift must not stop every other
    agent's runs); with --strict, a refusal (for a deploy that should stop there)."""
    drifted = prompt_drift(DEFAULT_DB_ALIAS)
    connections[DEFAULT_DB_ALIAS].close()
    if not drifted:
        return
    lines = [drift.describe() for drift in drifted]
    if strict:
        raise CommandError(
            "refusing to start (--strict): " + "; ".join(lines) + ". Give each changed agent a "
            "new version, or restore its definition."
        )
    for line in lines:
        logger.warning(
            "%s (they wait for a worker with their definition: give the changed agent a new "
            "version with upgrades_from, or restore the old definition)",
            line,
        )


def _report_held_leases(worker_id: str) -> None:
    """After a burst: runs that another worker's lease still holds (one that was killed, say)
    were not claimable; say how many and when the last comes free, rather than let "0 claims"
    read as "nothing to do"."""
    held = runs_held_by_others(worker_id)
    connections[DEFAULT_DB_ALIAS].close()
    if held is None:
        return
    count, last = held
    seconds = max(0.0, (last - timezone.now()).total_seconds())
    logger.info(
        "%d run%s held by other workers' leases; the last expires in %.0f s (%s UTC)",
        count,
        " is" if count == 1 else "s are",
        seconds,
        last.astimezone(datetime.UTC).strftime("%H:%M:%S"),
    )


def _metrics_address(port: int | None, addr: str | None) -> tuple[int, str] | None:
    """Where to serve metrics, or None; refuses before anything starts when that cannot be
    done (prometheus_client missing, a bad port)."""
    if port is None:
        if addr is not None:
            raise CommandError("--metrics-addr needs --metrics-port")
        return None
    if not 0 <= port <= 65535:
        raise CommandError(f"--metrics-port {port} is not a port number (0 to 65535)")
    if not prometheus.available():
        raise CommandError(
            "--metrics-port needs prometheus_client, which is not installed: "
            f"{prometheus.INSTALL_HINT}"
        )
    return port, addr or DEFAULT_METRICS_ADDR


def _serve_metrics(worker: Worker, port: int, addr: str) -> None:
    prometheus.enable()
    prometheus.track_worker(worker)
    try:
        server, _thread = prometheus.serve(port, addr)
    except OSError as exc:  # the port is taken, the address is not this host's
        raise CommandError(f"cannot serve metrics on {addr}:{port}: {exc}") from exc
    url = prometheus.metrics_url(server)
    logger.info("worker %s serves Prometheus metrics at %s", worker.worker_id, url)


def _ensure_database_ready(alias: str) -> None:
    """Stop with one line when the database cannot be reached or lacks durable_agents'
    migrations, instead of a worker logging the same traceback at every poll forever. The
    second says what the public API says (``NotMigrated``) when it meets a missing table."""
    connection = connections[alias]
    try:
        connection.ensure_connection()
        unapplied = unapplied_migrations(connection)
    except DatabaseError as exc:
        # Driver messages span lines (psycopg adds a hint); keep the log line one line.
        reason = " ".join(str(exc).split()) or type(exc).__name__
        raise CommandError(
            f"cannot reach the database {alias!r} ({connection.vendor}): {reason}"
        ) from exc
    finally:
        # The worker's threads open their own connections; do not keep this one idle for
        # the worker's lifetime (unless a caller's transaction is using it).
        if not connection.in_atomic_block:
            connection.close()
    if unapplied:
        raise CommandError(str(NotMigrated(alias, unapplied)))


def _raise_open_files_limit(concurrency: int) -> None:
    """Each run in flight keeps an HTTP connection to the model open: a worker with a thousand
    runs needs more descriptors than the usual soft limit of 1,024. Raise the soft limit to
    the hard one (what any server does), and say so if that is still short."""
    try:
        import resource
    except ImportError:  # not on POSIX
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = 2 * concurrency + 64
    if soft != resource.RLIM_INFINITY and soft < needed:
        target = hard if hard == resource.RLIM_INFINITY else max(soft, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if soft != resource.RLIM_INFINITY and soft < needed:
        logger.warning(
            "the open files limit is %d; --concurrency %d may need about %d (ulimit -n)",
            soft,
            concurrency,
            needed,
        )


def _tune_garbage_collector(threshold: int) -> None:
    """A worker keeps what its start-up loaded (Django, the SDK, the agents: a few hundred
    thousand objects) for its whole life, and every step allocates many short-lived objects
    that reference counting frees at once. Frozen (``gc.freeze``), the start-up objects are
    no longer walked by each full collection; and a young collection comes every
    ``threshold`` allocations not yet freed instead of every 700, which a thousand runs in
    flight reach over and over. ``WORKER_GC_THRESHOLD`` 0 leaves the collector as it is."""
    if threshold <= 0:
        return
    gc.collect()
    gc.freeze()
    _, middle, oldest = gc.get_threshold()
    gc.set_threshold(threshold, middle, oldest)
    logger.info(
        "garbage collector: %d objects of the start-up frozen, a young collection every %d "
        "allocations (WORKER_GC_THRESHOLD)",
        gc.get_freeze_count(),
        threshold,
    )


def _limit_malloc_arenas() -> None:
    """glibc gives threads up to 8 malloc arenas per core, and memory freed in one arena is
    not reused by another: with a thread per run in flight that fragmentation, not the runs,
    is most of a worker's memory. Two arenas keep it flat (what MALLOC_ARENA_MAX=2 does)."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if not name:
        return
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS)
        return
    m_arena_max = -8
    mallopt(m_arena_max, 2)


def _ensure_console_logging() -> None:
    """Progress lines must be visible even in a project that configured no handler."""
    logger = logging.getLogger("durable_agents")
    if logger.hasHandlers():
        return
    handler = logging.StreamHandler()
    handler.setFormatter(
        logging.Formatter("%(asctime)s %(levelname)s [run=%(run_id)s] %(name)s: %(message)s")
    )
    logger.addHandler(handler)
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
