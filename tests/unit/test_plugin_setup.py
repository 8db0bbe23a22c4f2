"""A project that uses the pytest plugin's fixtures without telling pytest-django where its
settings are gets a failure that says what to set, not "1 skipped" (a green run that tested
nothing); without pytest-django, one that says to install it.

Each case runs pytest itself in a subprocess (``pytester``), in a directory of its own with
neither a settings module nor DJANGO_SETTINGS_MODULE."""

from __future__ import annotations

import os

import pytest

from tests.conftest import ROOT

pytest_plugins = ["pytester"]

USERS_TESTS = """
def test_with_the_runner(agent_runner):
    assert agent_runner is not None


def test_with_the_clock(durable_clock):
    assert durable_clock is not None


def test_with_the_offline_model(offline_model):
    pass


def test_with_replay(replay_run):
    pass


@pytest.fixture
def my_runner(agent_runner):
    return agent_runner


def test_through_a_fixture_of_the_project(my_runner):
    pass


def test_with_a_plan(durable_plan):
    assert "lookup" in durable_plan(("lookup", {"key": "a"}))
"""


@pytest.fixture
def without_settings(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    """A project directory with the test module above; no DJANGO_SETTINGS_MODULE anywhere.
    Plugins are loaded by name, not by entry point: the same whether or not durable_agents
    is pip-installed here."""
    monkeypatch.delenv("DJANGO_SETTINGS_MODULE", raising=False)
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    pytester.makepyfile(test_users_agents="import pytest\n" + USERS_TESTS)
    pytester.makeini("[pytest]\n")  # the rootdir: not this repository's pyproject.toml


def test_fixtures_without_django_settings_fail_and_say_what_to_set(
    pytester: pytest.Pytester, without_settings: None
) -> None:
    result = pytester.runpytest_subprocess(
        "-p", "pytest_django.plugin", "-p", "durable_agents.pytest_plugin", "-rN"
    )
    outcomes = result.parseoutcomes()
    assert "skipped" not in outcomes, result.stdout.str()
    # Each test errs at its setup, with the message (durable_plan imports the models too).
    assert outcomes == {"errors": 6}, result.stdout.str()
    output = result.stdout.str()
    assert output.count("needs Django's settings") == 6
    assert "fixture 'agent_runner'" in output
    assert "DJANGO_SETTINGS_MODULE" in output
    assert "--ds=" in output
    assert "[tool.pytest.ini_options]" in output
    assert "Traceback" not in output  # the message, not the plugin's stack


def test_fixtures_without_pytest_django_say_to_install_it(
    pytester: pytest.Pytester, without_settings: None
) -> None:
    result = pytester.runpytest_subprocess("-p", "durable_agents.pytest_plugin", "-rN")
    outcomes = result.parseoutcomes()
    assert outcomes == {"errors": 6}, result.stdout.str()
    output = result.stdout.str()
    assert output.count("needs pytest-django") == 6
    assert "django-durable-agents[test]" in output
    assert "fixture 'db' not found" not in output
