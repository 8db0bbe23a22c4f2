"""Test settings: PostgreSQL when DATABASE_URL is set (make test sets it), else SQLite."""

import json
import os
from pathlib import Path

from project.settings import *  # noqa: F403
from project.settings import DATABASES, INSTALLED_APPS

INSTALLED_APPS = [*INSTALLED_APPS, "django_q", "tests.testapp"]

# django-q2 runs notification tasks inline in tests, so the async path itself is exercised.
Q_CLUSTER = {
    "name": "durable_agents_tests",
    "orm": "default",
    "sync": True,
    "timeout": 60,
    "retry": 120,
}

if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # A file, not :memory:, so that worker threads and subprocesses share the test database.
    _name = Path(DATABASES["default"]["NAME"])
    DATABASES["default"]["TEST"] = {"NAME": str(_name.with_name(f"test-{_name.name}"))}

DURABLE_AGENTS = {
    # Subprocess workers of the tests that use a fake API over HTTP get this set to 0.
    "OFFLINE": os.environ.get("DURABLE_AGENTS_OFFLINE", "1") == "1",
    "LEASE_SECONDS": 5,
    "HEARTBEAT_SECONDS": 1,
    "POLL_INTERVAL": 0.05,
    # The test client's host: mails link whole URLs, as a deployment's would.
    "SITE_URL": "http://testserver",
}
# The test app's irreversible tools are slow on purpose (a crash or a shutdown mid-call is what
# the tests make happen): the warning about their timeout and the grace is known.
SILENCED_SYSTEM_CHECKS = ["durable_agents.W008"]
# Lets a test give its worker subprocesses a small dead-letter threshold (test_crash.py).
if os.environ.get("DURABLE_AGENTS_MAX_ATTEMPTS"):
    DURABLE_AGENTS["MAX_ATTEMPTS"] = int(os.environ["DURABLE_AGENTS_MAX_ATTEMPTS"])

# Any DURABLE_AGENTS keys for worker subprocesses, as a JSON object (tests of batches).
if os.environ.get("DA_SETTINGS"):
    DURABLE_AGENTS.update(json.loads(os.environ["DA_SETTINGS"]))

# Worker subprocesses of the in-flight and PgBouncer tests.
if os.environ.get("DA_DB_POOL_SIZE"):
    DURABLE_AGENTS["DB_POOL_SIZE"] = int(os.environ["DA_DB_POOL_SIZE"])
if os.environ.get("DA_POLL_INTERVAL"):
    DURABLE_AGENTS["POLL_INTERVAL"] = float(os.environ["DA_POLL_INTERVAL"])
# "0": poll only; a JSON object: DATABASES overrides for the listener (around PgBouncer).
if os.environ.get("DA_LISTEN"):
    DURABLE_AGENTS["LISTEN"] = (
        False if os.environ["DA_LISTEN"] == "0" else json.loads(os.environ["DA_LISTEN"])
    )

PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]

# Worker subprocesses of the failover tests: several hosts, as libpq takes them ("h1,h2",
# "p1,p2"), connecting to whichever is the primary now.
if os.environ.get("DA_DB_HOSTS"):
    DATABASES["default"]["HOST"] = os.environ["DA_DB_HOSTS"]
    DATABASES["default"]["PORT"] = os.environ["DA_DB_PORTS"]
    DATABASES["default"].setdefault("OPTIONS", {}).update(
        {"target_session_attrs": "read-write", "connect_timeout": 5}
    )
