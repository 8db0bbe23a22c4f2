"""pytest fixtures for projects that use durable_agents (needs pytest-django).

Enabled automatically when durable_agents is installed with pip (a ``pytest11`` entry point),
or with ``pytest_plugins = ["durable_agents.pytest_plugin"]`` in a conftest.py.

    def test_migrator_asks_before_dropping(agent_runner, durable_plan):
        result = agent_runner("migrator", durable_plan(("drop_table", {"table": "old"})),
                              intents="wait")
        assert result.status == "waiting"
        assert result.intents[0].tool == "drop_table"

    def test_the_refund_waits_for_the_provider(agent_runner, durable_clock):
        result = agent_runner("support", task, events={"refund:o-1": {"status": "done"}})
        assert result.status == "succeeded"
        assert durable_clock.offset == 0  # the event came before the timeout

    def test_the_report_runs_every_morning(agent_runner, durable_clock):
        durable_agents.schedule("report", agent="reporter", task="Summarise.",
                                cron="0 6 * * *", timezone="Europe/Berlin")
        durable_clock.advance(days=1)      # fires the slots of that day, without sleeping
        (run,) = durable_clock.fired       # only the newest missed slot unless catch_up=True
        assert agent_runner.drive(run).status == "succeeded"

    def test_refunds_still_match(replay_run):
        assert replay_run(RUN_ID).ok  # today's tools give the recorded results

Every fixture needs Django configured (pytest-django with ``DJANGO_SETTINGS_MODULE``). Without
it pytest-django would skip each test that uses one ("no Django settings"): a green run that
tested nothing. Such a test fails at its setup instead, with what to set.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

# The fixtures below: each needs Django's settings (durable_plan too, which imports the models).
FIXTURES = frozenset(
    {"offline_model", "durable_clock", "agent_runner", "durable_plan", "replay_run"}
)

NO_PYTEST_DJANGO = (
    "durable_agents' fixture {fixture!r} needs pytest-django, which is not active: "
    'pip install "django-durable-agents[test]" (or pytest-django>=4.8).'
)
NO_SETTINGS = """durable_agents' fixture {fixture!r} needs Django's settings, and pytest-django \
found none (it would skip this test). Tell it your settings module, in one of these ways:
  - in pyproject.toml:
        [tool.pytest.ini_options]
        DJANGO_SETTINGS_MODULE = "yourproject.settings"
    (or DJANGO_SETTINGS_MODULE = yourproject.settings under [pytest] in pytest.ini);
  - on the command line: pytest --ds=yourproject.settings;
  - in the environment: DJANGO_SETTINGS_MODULE=yourproject.settings pytest."""


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Before any fixture of a test that uses one of ours: fail, with what to do, where
    pytest-django is missing or has no settings."""
    used = sorted(FIXTURES.intersection(getattr(item, "fixturenames", ())))
    if not used:
        return
    problem = _django_problem(item.config)
    if problem is not None:
        pytest.fail(problem.format(fixture=used[0]), pytrace=False)


def _django_problem(config: pytest.Config) -> str | None:
    try:
        from pytest_django import plugin as pytest_django_plugin
        from pytest_django.lazy_django import django_settings_is_configured
    except ImportError:
        return NO_PYTEST_DJANGO
    if not config.pluginmanager.is_registered(pytest_django_plugin):
        return NO_PYTEST_DJANGO
    if not django_settings_is_configured():
        return NO_SETTINGS
    return None


@pytest.fixture
def offline_model(settings: Any) -> Iterator[None]:
    """The offline scripted model answers every model call in this test."""
    from durable_agents.testing import offline_model as force_offline

    with force_offline():
        yield


@pytest.fixture
def durable_clock(db: None) -> Any:
    """The test's ``FakeClock``: ``durable_clock.advance(seconds)`` (or ``advance(minutes=,
    hours=, days=)``) brings every waiting run's timer and timeout that much closer and fires
    the schedule slots that fall due on the way (as the workers would: only the newest missed
    slot of a schedule without ``catch_up``), appending their runs to ``durable_clock.fired``;
    ``agent_runner`` advances it by itself when a run has nothing else to wait for, and
    ``offset`` says how far it went."""
    from durable_agents.testing import FakeClock

    return FakeClock()


@pytest.fixture
def agent_runner(db: None, offline_model: None, durable_clock: Any) -> Any:
    """``agent_runner(agent, task, intents=, events=, answers=, timers=, children=)`` ->
    RunResult; ``agent_runner.drive(result)`` drives a run further. Both use
    ``durable_clock``."""
    from durable_agents.testing import AgentRunner

    return AgentRunner(durable_clock, offline=False)


@pytest.fixture
def durable_plan() -> Callable[..., str]:
    """``durable_plan(("tool", {...}), [("a", {...}), ("b", {...})])`` -> a task text."""
    from durable_agents.testing import plan

    return plan


@pytest.fixture
def replay_run(db: None) -> Callable[..., Any]:
    """``replay_run(run_id, allow_effects=...)`` -> ReplayReport: the run's recorded tool calls
    played to today's tool code, in the test's database, without a model call."""
    from durable_agents.testing import replay

    return replay
