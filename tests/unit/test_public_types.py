"""A user's type checker sees the real signatures of the public surface, although the run
operations are imported lazily at run time."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from mypy import api as mypy_api

ROOT = Path(__file__).resolve().parents[2]

USER_CODE = """\
import durable_agents

run = durable_agents.start_run("migrator", "Migrate the orders table.", model="claude-x")
reveal_type(run)
reveal_type(durable_agents.cancel_run(run.id))
durable_agents.start_run("migrator", "task", "v1", "claude-x", 1, 2)
durable_agents.send_event("refund:7", {"status": "paid"}, None)
durable_agents.no_such_operation()
durable_agents.tool(effect="pur")
reveal_type(durable_agents.tool(effect="pure"))
durable_agents.start_run("migrator", "Migrate the orders table.", key="ticket-7")
durable_agents.start_run("migrator", "Migrate the orders table.", key=7)
durable_agents.start_run("migrator", "Migrate the orders table.", priority=90)
durable_agents.start_run("migrator", "Migrate the orders table.", priority="urgent")
"""


@pytest.fixture(scope="module")
def mypy_report(tmp_path_factory: pytest.TempPathFactory) -> dict[int, str]:
    """mypy's lines about the user's code, by line number (it reads durable_agents from the
    checkout, as an installed package with py.typed)."""
    folder = tmp_path_factory.mktemp("user_project")
    snippet = folder / "user_code.py"
    snippet.write_text(USER_CODE)
    stdout, stderr, _ = mypy_api.run(
        [
            str(snippet),
            "--strict",
            "--python-version=3.11",
            "--follow-imports=silent",  # report the user's code, not ours
            "--no-error-summary",
            "--show-error-codes",
            f"--cache-dir={folder / 'cache'}",
            "--config-file=",  # the user's settings, not this repository's
        ]
    )
    assert not stderr, stderr
    lines: dict[int, str] = {}
    for line in stdout.splitlines():
        where, _, message = line.partition(": ")
        if where.startswith(str(snippet)):
            number = int(where.rsplit(":", 1)[1])
            lines[number] = lines.get(number, "") + message + "\n"
    return lines


def test_start_run_returns_an_agent_run(mypy_report: dict[int, str]) -> None:
    assert 'Revealed type is "durable_agents.models.runs.AgentRun"' in mypy_report[4]
    assert 'Revealed type is "bool"' in mypy_report[5]
    assert 3 not in mypy_report, mypy_report[3]  # keyword arguments as documented


def test_optional_arguments_are_keyword_only(mypy_report: dict[int, str]) -> None:
    assert "Too many positional arguments" in mypy_report[6]
    assert "Too many positional arguments" in mypy_report[7]


def test_a_start_key_is_an_optional_str(mypy_report: dict[int, str]) -> None:
    assert 11 not in mypy_report, mypy_report[11]
    assert 'incompatible type "int"; expected "str | None"' in mypy_report[12]


def test_priority_is_a_typed_keyword(mypy_report: dict[int, str]) -> None:
    assert 13 not in mypy_report, mypy_report[13]
    assert 'incompatible type "str"; expected "int"' in mypy_report[14]


def test_a_misspelt_operation_is_an_error(mypy_report: dict[int, str]) -> None:
    assert "has no attribute" in mypy_report[8]


def test_tool_takes_only_the_four_effects(mypy_report: dict[int, str]) -> None:
    assert "No overload variant" in mypy_report[9]
    assert "durable_agents.declare.tools.Tool" in mypy_report[10]


def test_importing_the_package_loads_no_operations() -> None:
    # What makes the lazy import necessary: settings modules import durable_agents.
    code = textwrap.dedent(
        """
        import sys
        import durable_agents
        assert "durable_agents.api" not in sys.modules, "api imported"
        assert "durable_agents.models" not in sys.modules, "models imported"
        """
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
