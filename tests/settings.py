"""Test settings: PostgreSQL when DATABASE_URL is set (make test sets it), else SQLite."""

from project.settings import *  # noqa: F403
from project.settings import DATABASES, INSTALLED_APPS

INSTALLED_APPS = [*INSTALLED_APPS, "tests.testapp"]

if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    DATABASES["default"]["NAME"] = str(BASE_DIR / "test-run.sqlite3")  # noqa: F405
    DATABASES["default"]["TEST"] = {"NAME": str(BASE_DIR / "test.sqlite3")}  # noqa: F405

DURABLE_AGENTS = {
    "OFFLINE": True,
    "LEASE_SECONDS": 5,
    "HEARTBEAT_SECONDS": 1,
    "POLL_INTERVAL": 0.05,
}

PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
