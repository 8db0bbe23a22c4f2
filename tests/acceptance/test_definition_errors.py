"""A tool declared without its effect (or with one that does not exist) in an app's
``agents.py`` stops ``manage.py`` with one message that names the function, its module and
how to write it, not the 30-line traceback of Django loading the apps.

Real subprocesses: ``manage.py check`` with a settings module and an app written to a
temporary directory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

TIMEOUT = 60

SETTINGS = """
from tests.settings import *  # noqa: F403
from tests.settings import INSTALLED_APPS

INSTALLED_APPS = [*INSTALLED_APPS, "badtools"]
"""


def manage_check(tmp_path: Path, agents_py: str) -> subprocess.CompletedProcess[str]:
    app = tmp_path / "badtools"
    app.mkdir()
    (app / "__init__.py").write_text("")
    (app / "agents.py").write_text(agents_py)
    (tmp_path / "badtools_settings.py").write_text(SETTINGS)
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "badtools_settings",
        "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)]),
        "DATABASE_URL": f"sqlite:///{tmp_path / 'unused.sqlite3'}",
    }
    return subprocess.run(
        [sys.executable, str(ROOT / "manage.py"), "check"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=TIMEOUT,
    )


@pytest.mark.parametrize(
    ("decorator", "problem"),
    [
        ("@tool", "missing effect"),
        ("@tool()", "missing effect"),
        ('@tool(effect="read")', "'read' is not an effect"),
    ],
    ids=["bare", "no-effect", "unknown-effect"],
)
def test_a_tool_without_its_effect_is_one_short_message(
    tmp_path: Path, decorator: str, problem: str
) -> None:
    done = manage_check(
        tmp_path,
        "from durable_agents import tool\n"
        "\n"
        "\n"
        f"{decorator}\n"
        "def lookup_order(order_id: str) -> str:\n"
        '    """Find an order."""\n'
        "    return order_id\n",
    )
    output = done.stdout
    assert done.returncode != 0, output
    lines = output.strip().splitlines()
    assert len(lines) < 15, output
    assert "Traceback" not in output
    assert "During handling of the above exception" not in output
    assert "lookup_order" in output  # the function
    assert "badtools.agents" in output  # its module
    assert "agents.py, line 4" in output  # where the decorator is
    assert problem in output
    assert '@tool(effect="pure")' in output  # how to write it
    for effect in ("pure", "idempotent", "non_idempotent", "irreversible"):
        assert f'"{effect}"' in output  # which effects exist


def test_other_errors_of_an_agents_module_keep_their_traceback(tmp_path: Path) -> None:
    # Only our definition errors are shortened: a bug of the project's own is shown whole.
    done = manage_check(tmp_path, "raise RuntimeError('a bug of the project')\n")
    assert done.returncode != 0
    assert "Traceback" in done.stdout
    assert "RuntimeError: a bug of the project" in done.stdout
