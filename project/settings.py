"""Settings of the demo project: SQLite unless DATABASE_URL is set; the offline model while
DEBUG is on, unless DURABLE_AGENTS_OFFLINE says otherwise."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import dj_database_url

BASE_DIR = Path(__file__).resolve().parent.parent

SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "demo-only-not-secret")
DEBUG = os.environ.get("DJANGO_DEBUG", "1") == "1"
ALLOWED_HOSTS = ["localhost", "127.0.0.1", "[::1]", "testserver"]

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "durable_agents",
    "project.demo",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "project.urls"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

WSGI_APPLICATION = "project.wsgi.application"

SQLITE_PATH = BASE_DIR / "demo.sqlite3"
DATABASES = {
    "default": dj_database_url.config(
        default=f"sqlite:///{SQLITE_PATH}",
        conn_max_age=600,
        conn_health_checks=True,
    )
}
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # IMMEDIATE takes the write lock when a transaction begins, so two workers can never
    # both read a run as claimable; the timeout makes the loser wait instead of failing.
    DATABASES["default"].setdefault("OPTIONS", {}).update(
        {"transaction_mode": "IMMEDIATE", "timeout": 20}
    )

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
USE_TZ = True
TIME_ZONE = "UTC"
STATIC_URL = "static/"

DURABLE_AGENTS: dict[str, Any] = {
    # The built-in offline scripted model plays the tool calls written in a run's task text, so
    # it is switched on explicitly (DURABLE_AGENTS_OFFLINE=1 or 0) and by default only with
    # DEBUG on. Never derive it from a missing API key: a worker host without the key would
    # then run whatever tool calls a task names. With DEBUG off it is a system check error
    # (durable_agents.E011) and `runagents` refuses to start without --allow-offline.
    "OFFLINE": os.environ.get("DURABLE_AGENTS_OFFLINE", "1" if DEBUG else "0") == "1",
    # Where the demo's admin is served (`make admin`): the links in notification mails are this
    # followed by the page's path.
    "SITE_URL": os.environ.get("DJANGO_SITE_URL", "http://127.0.0.1:8000"),
}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {
        "run": {"format": "%(asctime)s %(levelname)s [run=%(run_id)s] %(name)s: %(message)s"},
    },
    "filters": {"run_id": {"()": "durable_agents.logging.RunIdFilter"}},
    "handlers": {
        "console": {"class": "logging.StreamHandler", "formatter": "run", "filters": ["run_id"]},
    },
    "root": {"handlers": ["console"], "level": "WARNING"},
    "loggers": {
        "durable_agents": {"level": os.environ.get("DURABLE_AGENTS_LOG_LEVEL", "INFO")},
        "project": {"level": os.environ.get("DURABLE_AGENTS_LOG_LEVEL", "INFO")},
    },
}
