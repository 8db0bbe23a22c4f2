"""Test settings: PostgreSQL when DATABASE_URL is set (make test sets it), else SQLite."""

from project.settings import *  # noqa: F403
import os
from pathlib import Path

from project.settings import DATABASES, INSTALLED_APPS

INSTALLED_APPS = [*INSTALLED_APPS, "tests.testapp"]

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
}

PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
