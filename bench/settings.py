"""Settings of the benchmarks: the demo project plus the bench app, against the fake API over HTTP.

DATABASE_URL must name a PostgreSQL database whose name starts with ``da_bench``.
"""

import json
import os

from project.settings import *  # noqa: F403
from project.settings import DATABASES, INSTALLED_APPS, LOGGING

INSTALLED_APPS = [*INSTALLED_APPS, "django_q", "bench.benchapp"]

# Direct connections (no transaction pooler in between): let psycopg prepare the statements it
# runs often, the step commit first of all (docs/howto/database.md, "Database connections and
# pooling").
DATABASES["default"].setdefault("OPTIONS", {})["prepare_threshold"] = 5
DEBUG = False  # DEBUG=True makes Django keep every query in memory

DURABLE_AGENTS = {
    "OFFLINE": False,  # the fake API over HTTP answers, through the real SDK
    "LEASE_SECONDS": 60,
    "HEARTBEAT_SECONDS": 20,
    "POLL_INTERVAL": 0.05,
    "MODEL_RETRIES": 2,
    "NOTIFY": False,
}
# bench/quota.py runs the app as a new user would (the default MODEL_RETRIES) and, when asked,
# with RATE_LIMITS (JSON).
if os.environ.get("DA_BENCH_MODEL_RETRIES"):
    DURABLE_AGENTS["MODEL_RETRIES"] = int(os.environ["DA_BENCH_MODEL_RETRIES"])
if os.environ.get("DA_BENCH_RATE_LIMITS"):
    DURABLE_AGENTS["RATE_LIMITS"] = json.loads(os.environ["DA_BENCH_RATE_LIMITS"])
# bench/keys_crash.py: per-key limits (JSON), and a short lease, so that the runs of a worker it
# kills come back within seconds (the heartbeat stays under a third of the lease).
if os.environ.get("DA_BENCH_CONCURRENCY_LIMITS"):
    DURABLE_AGENTS["CONCURRENCY_LIMITS"] = json.loads(os.environ["DA_BENCH_CONCURRENCY_LIMITS"])
if os.environ.get("DA_BENCH_LEASE_SECONDS"):
    DURABLE_AGENTS["LEASE_SECONDS"] = float(os.environ["DA_BENCH_LEASE_SECONDS"])
if os.environ.get("DA_BENCH_HEARTBEAT_SECONDS"):
    DURABLE_AGENTS["HEARTBEAT_SECONDS"] = float(os.environ["DA_BENCH_HEARTBEAT_SECONDS"])
# bench/inflight.py varies the worker's connection pool (set only when asked: a worker without
# the pool does not know the key).
if os.environ.get("DA_BENCH_POOL_SIZE"):
    DURABLE_AGENTS["DB_POOL_SIZE"] = int(os.environ["DA_BENCH_POOL_SIZE"])

Q_CLUSTER = {
    "name": "da_bench",
    "orm": "default",
    "workers": int(os.environ.get("BENCH_Q_WORKERS", "1")),
    "poll": 0.05,
    "timeout": 60,
    "retry": 120,
    "save_limit": 0,  # keep every result: the benchmark counts them
    "ack_failures": True,
    "catch_up": False,
    "log_level": "WARNING",
}

# The worker logs a line per committed step at INFO; the benchmarks measure the hot path with
# WARNING unless BENCH_LOG_LEVEL says otherwise (bench/profile_step.py measures the INFO cost).
LOGGING = {
    **LOGGING,
    "loggers": {
        **LOGGING["loggers"],
        "durable_agents": {"level": os.environ.get("BENCH_LOG_LEVEL", "WARNING")},
    },
}

_name = DATABASES["default"].get("NAME") or ""
if DATABASES["default"]["ENGINE"] != "django.db.backends.postgresql" or not str(_name).startswith(
    "da_bench"
):
    raise RuntimeError(f"bench.settings needs a PostgreSQL database named da_bench*, got {_name!r}")
# bench/live_readers.py: the readers' caps of the server it starts, and a name for that
# server's connections, so that its backends can be told apart in pg_stat_activity.
if os.environ.get("DA_BENCH_LIVE_MAX_READERS"):
    DURABLE_AGENTS["LIVE_MAX_READERS"] = int(os.environ["DA_BENCH_LIVE_MAX_READERS"])
    DURABLE_AGENTS["LIVE_MAX_READERS_PER_RUN"] = int(os.environ["DA_BENCH_LIVE_MAX_READERS"])
if os.environ.get("DA_BENCH_APPLICATION_NAME"):
    DATABASES["default"]["OPTIONS"]["application_name"] = os.environ["DA_BENCH_APPLICATION_NAME"]
if os.environ.get("DA_BENCH_CONN_MAX_AGE"):
    DATABASES["default"]["CONN_MAX_AGE"] = int(os.environ["DA_BENCH_CONN_MAX_AGE"])
