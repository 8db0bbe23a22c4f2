#!/usr/bin/env bash
# Build the wheel, install it into a fresh venv outside the repository, and use it from a
# minimal Django project: its name and py.typed, checks, migrations, the admin templates, a run to
# its end offline.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$repo/.venv/bin/python" -m pip wheel --quiet --no-deps --wheel-dir "$work/dist" "$repo"
# The distribution is django-durable-agents (durable-agents on the index is another project);
# the import name is durable_agents, and the package ships its py.typed marker.
wheels=("$work"/dist/*.whl)
[ "${#wheels[@]}" -eq 1 ] || { echo "expected one wheel, got: ${wheels[*]}" >&2; exit 1; }
wheel=${wheels[0]}
case "$(basename "$wheel")" in
  django_durable_agents-*) echo "wheel: $(basename "$wheel")" ;;
  *) echo "the wheel is $(basename "$wheel"); expected django_durable_agents-*" >&2; exit 1 ;;
esac
listing=$("$repo/.venv/bin/python" -m zipfile -l "$wheel")
grep -qE '^durable_agents/py\.typed[[:space:]]' <<<"$listing" \
  || { echo "the wheel lacks durable_agents/py.typed" >&2; exit 1; }
python3 -m venv "$work/venv"
"$work/venv/bin/pip" install -qq "$wheel"
# And by its name: what `pip install django-durable-agents` resolves to is this wheel (only the
# local directory is searched; the dependencies are in place from the line above).
"$work/venv/bin/pip" install -qq --no-index --find-links "$work/dist" --force-reinstall \
  --no-deps django-durable-agents
"$work/venv/bin/python" -c "import importlib.metadata as m; print('installed', m.version('django-durable-agents'))"
mkdir -p "$work/site/shop"
touch "$work/site/shop/__init__.py"
cat > "$work/site/shop/agents.py" <<'PY'
from durable_agents import Agent, tool

@tool(effect="pure")
def lookup(key: str) -> str:
    """Look a key up."""
    return key.upper()

helper = Agent(name="helper", version="1", model="claude-x-1", system="Help.", tools=[lookup])
PY
cat > "$work/site/settings.py" <<'PY'
SECRET_KEY = "wheel-check"
INSTALLED_APPS = ["django.contrib.admin", "django.contrib.auth", "django.contrib.contenttypes",
                  "django.contrib.sessions", "django.contrib.messages", "durable_agents", "shop"]
DATABASES = {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": "db.sqlite3",
                         "OPTIONS": {"transaction_mode": "IMMEDIATE"}}}
TEMPLATES = [{"BACKEND": "django.template.backends.django.DjangoTemplates", "APP_DIRS": True,
              "OPTIONS": {"context_processors": ["django.contrib.auth.context_processors.auth",
                          "django.contrib.messages.context_processors.messages",
                          "django.template.context_processors.request"]}}]
MIDDLEWARE = ["django.contrib.sessions.middleware.SessionMiddleware",
              "django.contrib.auth.middleware.AuthenticationMiddleware",
              "django.contrib.messages.middleware.MessageMiddleware"]
ROOT_URLCONF = "urls"
USE_TZ = True
DEBUG = True
DURABLE_AGENTS = {"OFFLINE": True, "SITE_URL": "http://127.0.0.1:8000"}
PY
cat > "$work/site/urls.py" <<'PY'
from django.contrib import admin
from django.urls import path
urlpatterns = [path("admin/", admin.site.urls)]
PY
cd "$work/site"
export DJANGO_SETTINGS_MODULE=settings PYTHONPATH="$work/site"
py="$work/venv/bin/python"
"$py" -c "import durable_agents, sys; assert '$repo' not in durable_agents.__file__, durable_agents.__file__; print('installed at', durable_agents.__file__)"
"$work/venv/bin/django-admin" check --fail-level WARNING
"$work/venv/bin/django-admin" migrate --verbosity 0
"$py" - <<'PY'
import django
django.setup()
import durable_agents
from django.core.management import call_command
from django.template.loader import get_template
get_template("admin/durable_agents/agentrun/change_form.html")
run = durable_agents.start_run("helper", 'Look.\n@lookup {"key": "abc"}')
call_command("runagents", "--burst")
run.refresh_from_db()
assert run.status == "succeeded", (run.status, run.error)
print("wheel check: run", run.id, run.status)
PY
