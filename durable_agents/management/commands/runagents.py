"""``python manage.py runagents``: a disposable worker that advances durable agent runs."""

from __future__ import annotations

import logging
from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from durable_agents.worker import Worker


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
        parser.add_argument("--lease-seconds", type=float, default=None)
        parser.add_argument("--poll-interval", type=float, default=None)
        parser.add_argument(
            "--grace-seconds",
            type=float,
            default=None,
            help="after SIGTERM, how long steps in flight may take to commit (default: the "
            "SHUTDOWN_GRACE_SECONDS setting); 0 abandons them at once",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        _ensure_console_logging()
        worker = Worker(
            worker_id=options["worker_id"],
            concurrency=options["concurrency"],
            burst=options["burst"],
            max_runs=options["max_runs"],
            lease_seconds=options["lease_seconds"],
            poll_interval=options["poll_interval"],
            grace_seconds=options["grace_seconds"],
        )
        worker.run()


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
