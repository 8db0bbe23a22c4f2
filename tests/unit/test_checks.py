"""Each system check fires on its mistake and stays quiet otherwise."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

import pytest
from django.core import checks
from django.core.management import call_command
from django.core.management.base import SystemCheckError

from durable_agents import checks as da_checks
from durable_agents.declare.agents import Agent, registry
from durable_agents.declare.tools import tool


def ids(messages: list[checks.CheckMessage]) -> list[str]:
    return sorted(str(m.id) for m in messages)


def redact(tool_name: str, exc: BaseException) -> str:
    """A valid TOOL_ERROR_FORMATTER."""
    return f"{tool_name} failed"


NOT_CALLABLE = "a module attribute that is not callable"


@pytest.fixture(autouse=True)
def development(settings: Any) -> None:
    """pytest-django turns DEBUG off; the test settings (OFFLINE on) are development settings
    and are checked as such. The tests about DEBUG off turn it off themselves."""
    settings.DEBUG = True


def test_the_test_settings_pass() -> None:
    assert da_checks.check_settings() == []
    assert da_checks.check_agents() == []


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ({"LEASE_SECONDZ": 5}, ["durable_agents.E002"]),
        ({"LEASE_SECONDS": 0}, ["durable_agents.E003"]),
        ({"POLL_INTERVAL": "1"}, ["durable_agents.E003"]),
        ({"MAX_ATTEMPTS": 0}, ["durable_agents.E004"]),
        ({"MODEL_RETRIES": -1}, ["durable_agents.E004"]),
        ({"BETAS": "a-beta"}, ["durable_agents.E005"]),
        ({"CLIENT_FACTORY": "nowhere.factory"}, ["durable_agents.E006"]),
        ({"LEASE_SECONDS": 10, "HEARTBEAT_SECONDS": 8}, ["durable_agents.W001"]),
        ({"SHUTDOWN_GRACE_SECONDS": -1}, ["durable_agents.E003"]),
        ({"RETENTION_DAYS": 0}, ["durable_agents.E003"]),
        ({"RETENTION_BATCH": 0}, ["durable_agents.E004"]),
        ({"OFFLINE": "yes"}, ["durable_agents.E007"]),
        ({"OVERLAP_SAFE_COMMITS": 1}, ["durable_agents.E007"]),
        # Each problem has its own id: E005 and E006 used to name these too.
        ({"RETIRED_MODELS": "claude-2.1"}, ["durable_agents.E008"]),
        ({"ARCHIVER": "nowhere.archive"}, ["durable_agents.E009"]),
        ({"TOOL_TIMEOUT": 0}, ["durable_agents.E003"]),
        ({"TOOL_TIMEOUT": -5.0}, ["durable_agents.E003"]),
        ({"TOOL_TIMEOUT": "600"}, ["durable_agents.E003"]),
        ({"TOOL_TIMEOUT": None}, ["durable_agents.E003"]),
        ({"TOOL_ERROR_FORMATTER": "nowhere.format_error"}, ["durable_agents.E012"]),
        ({"TOOL_ERROR_FORMATTER": "tests.unit.test_checks.NOT_CALLABLE"}, ["durable_agents.E012"]),
        ({"TOOL_ERROR_FORMATTER": redact}, ["durable_agents.E012"]),  # a path, not the function
        # One error per problem of RATE_LIMITS.
        ({"RATE_LIMITS": {"*": {"requests_per_minute": 0}}}, ["durable_agents.E030"]),
        (
            {"RATE_LIMITS": {"*": {"requests_per_minute": "many", "tokens": 5}}},
            ["durable_agents.E030"],
        ),
        (
            {"RATE_LIMITS": {"a": {"input_tokens_per_minute": -1}, "b": []}},
            ["durable_agents.E030", "durable_agents.E030"],
        ),
        ({"RATE_LIMITS": ["claude"]}, ["durable_agents.E030"]),
        ({"BUDGETS": {"t": {"usd_per_day": -1}}}, ["durable_agents.E031"]),
        ({"BUDGETS": {"t": {"usd_per_day": "lots"}, "u": 5}}, ["durable_agents.E031"] * 2),
        ({"BUDGETS": {"t": {"usd": 5}}}, ["durable_agents.E031"]),
        ({"BUDGETS": {"": {"usd_per_day": 5}}}, ["durable_agents.E031"]),
        ({"BUDGETS": {"t": {"usd_per_day": float("nan")}}}, ["durable_agents.E031"]),
        ({"CONCURRENCY_LIMITS": [("tenant:a", 2)]}, ["durable_agents.E014"]),
        ({"CONCURRENCY_LIMITS": {"": 2}}, ["durable_agents.E015"]),
        ({"CONCURRENCY_LIMITS": {"k" * 201: 2}}, ["durable_agents.E015"]),
        ({"CONCURRENCY_LIMITS": {"a\x00b": 2}}, ["durable_agents.E015"]),
        ({"CONCURRENCY_LIMITS": {7: 2}}, ["durable_agents.E015"]),
        ({"CONCURRENCY_LIMITS": {"tenant:a": -1}}, ["durable_agents.E016"]),
        ({"CONCURRENCY_LIMITS": {"tenant:a": 2.0}}, ["durable_agents.E016"]),
        ({"CONCURRENCY_LIMITS": {"tenant:a": True}}, ["durable_agents.E016"]),
        ({"CONCURRENCY_LIMITS": {"tenant:a": None}}, ["durable_agents.E016"]),
        ({"CONCURRENCY_LIMITS": {"": -1}}, ["durable_agents.E015", "durable_agents.E016"]),
    ],
)
def test_invalid_settings(da_settings: Any, values: dict[str, Any], expected: list[str]) -> None:
    da_settings(**values)
    assert ids(da_checks.check_settings()) == expected


@pytest.mark.parametrize(
    "values",
    [
        {"TOOL_TIMEOUT": 0.5},
        {"TOOL_TIMEOUT": 30},
        {"TOOL_ERROR_FORMATTER": None},
        {"TOOL_ERROR_FORMATTER": "tests.unit.test_checks.redact"},
        {"RETIRED_MODELS": ["claude-2.1"]},
        {"RATE_LIMITS": {"*": {"requests_per_minute": 4000, "burst_seconds": 60}}},
        {"CONCURRENCY_LIMITS": {"tenant:a": 0, "tenant:b": 20}},  # 0: held (a pause)
    ],
)
def test_valid_settings(da_settings: Any, values: dict[str, Any]) -> None:
    da_settings(**values)
    assert da_checks.check_settings() == []


def test_the_formatter_message_says_what_is_wrong(da_settings: Any) -> None:
    da_settings(TOOL_ERROR_FORMATTER="tests.unit.test_checks.NOT_CALLABLE")
    [message] = da_checks.check_settings()
    assert "is not callable" in message.msg
    da_settings(TOOL_ERROR_FORMATTER="nowhere.format_error")
    [message] = da_checks.check_settings()
    assert "cannot be imported" in message.msg


def test_settings_that_are_not_a_dict(settings: Any) -> None:
    settings.DURABLE_AGENTS = ["LEASE_SECONDS", 5]
    assert ids(da_checks.check_settings()) == ["durable_agents.E001"]
    # Every other check runs on the defaults meanwhile, rather than crashing on the list.
    everything = [m for m in checks.run_checks() if str(m.id).startswith("durable_agents.")]
    assert "durable_agents.E001" in ids(everything)


def test_offline_without_debug_is_an_error(
    settings: Any, da_settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-x")
    da_settings(OFFLINE=True)
    settings.DEBUG = False
    [message] = da_checks.check_settings()
    assert message.id == "durable_agents.E011" == da_checks.OFFLINE_WITHOUT_DEBUG
    assert message.is_serious()
    assert message.hint is not None
    assert "--allow-offline" in message.hint
    # `manage.py check` fails on it (it said nothing before).
    with pytest.raises(SystemCheckError, match=r"durable_agents\.E011"):
        call_command("check")
    settings.DEBUG = True
    assert da_checks.check_settings() == []
    settings.DEBUG = False
    da_settings(OFFLINE=False)
    assert da_checks.check_settings() == []


def test_missing_api_key_warns_only_when_online(
    da_settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    monkeypatch.delenv("ANTHROPIC_AUTH_TOKEN", raising=False)
    da_settings(OFFLINE=False)
    assert ids(da_checks.check_settings()) == ["durable_agents.W002"]
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-x")
    assert da_checks.check_settings() == []
    da_settings(OFFLINE=True)
    monkeypatch.delenv("ANTHROPIC_API_KEY")
    assert da_checks.check_settings() == []


def test_sqlite_without_debug_warns(settings: Any) -> None:
    from django.db import connection

    settings.DEBUG = False
    found = ids(da_checks.check_database())
    if connection.vendor == "sqlite":
        assert found == ["durable_agents.W003"]
    else:
        assert found == []
    settings.DEBUG = True
    assert da_checks.check_database() == []


def test_non_idempotent_tool_without_a_key() -> None:
    @tool(effect="non_idempotent")
    def send_email(to: str) -> str:
        """Send an e-mail."""
        return to

    agent = Agent(name="mailer", version="v1", model="claude-x", system="s", tools=[send_email])
    try:
        messages = da_checks.check_agents()
        assert ids(messages) == ["durable_agents.E010"]
        assert "send_email" in messages[0].msg
        # The object is named by its dotted path, not `<function ... at 0x...>`.
        printed = str(messages[0])
        assert printed.startswith(
            "tests.unit.test_checks.test_non_idempotent_tool_without_a_key.<locals>.send_email: "
        ), printed
        assert " at 0x" not in printed
    finally:
        registry.unregister(agent.name, agent.version)
    assert da_checks.check_agents() == []


def test_a_context_edit_without_its_beta(settings: Any) -> None:
    compact = {"type": "compact_20260112", "trigger": {"type": "input_tokens", "value": 50000}}
    clear = {"type": "clear_tool_uses_20250919"}
    params = {"context_management": {"edits": [compact, clear]}}
    agent = Agent(name="long", version="v1", model="claude-x", system="s", params=params)
    try:
        [warning] = da_checks.check_agents()
        assert warning.id == "durable_agents.W004"
        assert "compact_20260112, clear_tool_uses_20250919" in warning.msg
        assert warning.hint is not None
        assert "'compact-2026-01-12'" in warning.hint
        settings.DURABLE_AGENTS = {"BETAS": ["compact-2026-01-12", "context-management-2025-06-27"]}
        assert da_checks.check_agents() == []
    finally:
        registry.unregister(agent.name, agent.version)
    with_beta = Agent(
        name="long",
        version="v2",
        model="claude-x",
        system="s",
        params={"context_management": {"edits": [compact]}},
        betas=["compact-2026-01-12"],
    )
    try:
        settings.DURABLE_AGENTS = {}
        assert da_checks.check_agents() == []
    finally:
        registry.unregister(with_beta.name, with_beta.version)


def test_checks_are_registered() -> None:
    # The registered checks are plain functions (the stubs type them as a protocol).
    registered = {c.__name__ for c in checks.registry.registry.get_checks()}  # type: ignore[attr-defined]
    assert {"check_settings", "check_database", "check_agents"} <= registered


def test_rate_limits_for_a_model_no_agent_uses_warn(da_settings: Any) -> None:
    da_settings(RATE_LIMITS={"claude-tset-1": {"requests_per_minute": 50}, "*": {}})
    (warning,) = [m for m in da_checks.check_agents() if m.id == "durable_agents.W030"]
    assert "'claude-tset-1'" in warning.msg


FABLE = {"input": 3.0, "output": 15.0}


@pytest.mark.parametrize(
    ("prices", "expected"),
    [
        (["claude-x"], ["durable_agents.E020"]),
        ({"claude-x": 3.0}, ["durable_agents.E020"]),
        ({"": FABLE}, ["durable_agents.E020"]),
        ({"claude-x": {"input": 3.0}}, ["durable_agents.E021"]),
        ({"claude-x": {}}, ["durable_agents.E021", "durable_agents.E021"]),
        ({"claude-x": {**FABLE, "cache_reads": 0.3}}, ["durable_agents.E022"]),
        ({"claude-x": {**FABLE, "output": "15"}}, ["durable_agents.E023"]),
        ({"claude-x": {**FABLE, "input": True}}, ["durable_agents.E023"]),
        ({"claude-x": {**FABLE, "cache_read": -0.1}}, ["durable_agents.E023"]),
        ({"claude-x": {**FABLE, "cache_write": float("nan")}}, ["durable_agents.E023"]),
        ({"claude-x": {**FABLE, "cache_write_1h": float("inf")}}, ["durable_agents.E023"]),
        # One id per problem, each problem once.
        (
            {"claude-x": {"input": None, "typo": 1}},
            ["durable_agents.E021", "durable_agents.E022", "durable_agents.E023"],
        ),
    ],
)
def test_invalid_prices(da_settings: Any, prices: Any, expected: list[str]) -> None:
    da_settings(PRICES=prices)
    assert ids(da_checks.check_settings()) == expected


@pytest.mark.parametrize(
    "prices",
    [
        {},
        {"claude-x": FABLE},
        {"*": {"input": 0, "output": 0}},
        {"claude-x": {**FABLE, "cache_read": 0.3, "cache_write": 3.75, "cache_write_1h": 6}},
    ],
)
def test_valid_prices(da_settings: Any, prices: Any) -> None:
    da_settings(PRICES=prices)
    assert da_checks.check_settings() == []


def test_a_price_for_a_model_no_agent_uses_is_likely_a_typo(da_settings: Any) -> None:
    agent = Agent(name="priced", version="v1", model="claude-x", system="s")
    try:
        da_settings(PRICES={"claude-x": FABLE, "*": FABLE})
        assert [m for m in da_checks.check_agents() if m.id == "durable_agents.W010"] == []
        da_settings(PRICES={"claude-y": FABLE})
        [warning] = [m for m in da_checks.check_agents() if m.id == "durable_agents.W010"]
        assert "'claude-y'" in warning.msg
        assert warning.hint is not None
        assert "claude-x" in warning.hint
    finally:
        registry.unregister(agent.name, agent.version)


def test_a_misspelt_setting_suggests_the_three_closest(settings: Any) -> None:
    settings.DURABLE_AGENTS = {**settings.DURABLE_AGENTS, "LEASE_SECOND": 30}
    [message] = da_checks.check_settings()
    assert message.id == "durable_agents.E002"
    assert message.hint is not None
    assert message.hint.startswith("Did you mean 'LEASE_SECONDS', '")
    assert message.hint.endswith("? All settings: docs/ref/settings.md")
    # Three names, not the ~40 of the whole table.
    assert message.hint.count("'") == 6, message.hint
    assert "ENCRYPTION_KEYS" not in message.hint
    # A key like none of them still gets three names to look at, never the whole list.
    settings.DURABLE_AGENTS = {"OFFLINE": True, "NOTHING_LIKE_IT": 1}
    [message] = da_checks.check_settings()
    assert message.hint is not None
    assert message.hint.startswith("Did you mean '")
    assert message.hint.count("'") == 6, message.hint
    # A key that is not even a string (a typo in a dict literal) is named all the same.
    settings.DURABLE_AGENTS = {"OFFLINE": True, 5: 1}
    [message] = da_checks.check_settings()
    assert message.hint is not None
    assert message.hint.endswith("All settings: docs/ref/settings.md")


def test_several_database_hosts_need_target_session_attrs() -> None:
    """Several hosts without target_session_attrs=read-write warn (W050): after a failover
    libpq may connect to a read-only standby. Ports that do not match the hosts are an error
    (E050)."""
    entry = {"ENGINE": "django.db.backends.postgresql", "NAME": "x", "HOST": "db1,db2"}
    check = da_checks.database_host_problems
    assert ids(check({"ha": {**entry, "PORT": "5432"}})) == ["durable_agents.W050"]
    primary_only = {"target_session_attrs": "read-write"}
    assert check({"ha": {**entry, "PORT": "5432,5433", "OPTIONS": primary_only}}) == []
    three = {**entry, "PORT": "1,2,3", "OPTIONS": {"target_session_attrs": "primary"}}
    assert ids(check({"ha": three})) == ["durable_agents.E050"]
    single = {**entry, "HOST": "db1", "PORT": "5432"}
    assert check({"default": single}) == []
    assert da_checks.check_database_hosts() == []  # the test settings: one host


# -- a top-level setting named like DURABLE_AGENTS but misspelt (W005) ----------------------


def misspelt(**run: Any) -> list[checks.CheckMessage]:
    """W005 as Django's checks framework reports it."""
    return [m for m in checks.run_checks(**run) if m.id == "durable_agents.W005"]


@pytest.mark.parametrize(
    "name",
    [
        "DURABLE_AGENT",
        "DURABLEAGENTS",
        "DURABLE_AGENTS_SETTINGS",
        "DURABLE_AGENTS_CONFIG",
        "DURABLE_AGENTS_CONF",
        "DURABEL_AGENTS",
        "DURABLE_AGNETS",
        "DURABLE__AGENTS",
        "DURABLE_AGENTS_",
    ],
)
def test_a_misspelt_durable_agents_setting_warns(settings: Any, name: str) -> None:
    setattr(settings, name, {"LEASE_SECONDS": 30})
    [warning] = misspelt()
    assert warning.level == checks.WARNING
    assert repr(name) in warning.msg
    assert "DURABLE_AGENTS" in warning.msg.replace(repr(name), "")
    assert warning.hint is not None
    assert "DURABLE_AGENTS" in warning.hint


def test_a_flat_durable_agents_key_warns_and_says_where_it_goes(settings: Any) -> None:
    settings.DURABLE_AGENTS_LEASE_SECONDS = 30
    [warning] = misspelt()
    assert "'DURABLE_AGENTS_LEASE_SECONDS'" in warning.msg
    assert warning.hint is not None
    assert "'LEASE_SECONDS'" in warning.hint


@pytest.mark.parametrize(
    ("name", "value"),
    [
        # Settings of the project's own that merely start like ours: not a dict, not one of
        # our keys.
        ("DURABLE_AGENTS_API_KEY", "sk-test"),
        ("DURABLE_AGENTS_ENABLED", True),
        ("AGENTS", {"LEASE_SECONDS": 30}),
        ("DURATIONS", {"short": 1}),
        ("DURABLE_QUEUES", {"default": {}}),
        ("CACHES", {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}}),
    ],
)
def test_unrelated_settings_do_not_warn(settings: Any, name: str, value: Any) -> None:
    setattr(settings, name, value)
    assert misspelt() == []


def test_the_right_name_does_not_warn(settings: Any) -> None:
    assert settings.DURABLE_AGENTS  # the test settings have it
    assert misspelt() == []


def test_a_lower_case_name_in_the_settings_module_warns(
    settings: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    """Django reads upper-case names only, so a lower-case one is found in the settings
    module itself."""
    (tmp_path / "lower_case_settings.py").write_text(
        "import durable_agents\n"  # a module of the same name is not a setting
        "durable_agents = {'LEASE_SECONDS': 30}\n"
        "agents = {'x': 1}\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    # Imported, as Django imports the settings module at start.
    importlib.import_module("lower_case_settings")
    request.addfinalizer(lambda: sys.modules.pop("lower_case_settings", None))
    settings.SETTINGS_MODULE = "lower_case_settings"
    [warning] = misspelt()
    assert "'durable_agents'" in warning.msg


def test_a_misspelt_setting_fails_check_at_warning_level_unless_silenced(settings: Any) -> None:
    settings.DURABLE_AGENT = {"OFFLINE": True}
    with pytest.raises(SystemCheckError, match=r"durable_agents\.W005"):
        call_command("check", fail_level="WARNING")
    settings.SILENCED_SYSTEM_CHECKS = [*settings.SILENCED_SYSTEM_CHECKS, "durable_agents.W005"]
    call_command("check", fail_level="WARNING")


# -- notification links (W007, E017) -----------------------------------------------------


def test_notification_mails_without_a_site_url_warn_at_start_up(
    da_settings: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    da_settings(NOTIFY=True, SITE_URL=None)
    [warning] = da_checks.check_notification_links()
    assert warning.id == "durable_agents.W007" == da_checks.NOTIFY_WITHOUT_SITE_URL
    assert "SITE_URL" in warning.msg
    assert warning.hint is not None
    assert "https://" in warning.hint
    assert '"NOTIFY": False' in warning.hint
    # `manage.py check` shows it.
    call_command("check")
    assert "durable_agents.W007" in capsys.readouterr().err
    da_settings(SITE_URL="https://agents.example.com")
    assert da_checks.check_notification_links() == []
    assert da_checks.check_settings() == []
    da_settings(NOTIFY=False, SITE_URL=None)
    assert da_checks.check_notification_links() == []
    # An empty value (an unset environment variable) is no SITE_URL: a warning, not an error.
    da_settings(NOTIFY=True, SITE_URL="")
    assert ids(da_checks.check_notification_links()) == ["durable_agents.W007"]
    assert da_checks.check_settings() == []


@pytest.mark.parametrize(
    "value",
    ["agents.example.com", "ftp://agents.example.com", "https://", "https://x.io/?a=1", 42],
)
def test_a_site_url_that_is_not_a_url_is_an_error(da_settings: Any, value: Any) -> None:
    da_settings(SITE_URL=value)
    [error] = da_checks.check_settings()
    assert error.id == "durable_agents.E017"
    assert "SITE_URL" in error.msg
    assert da_checks.check_notification_links() == []  # one message for one mistake


@pytest.mark.parametrize("value", ["http://127.0.0.1:8000", "https://example.com/tools/"])
def test_a_site_url_with_a_port_or_a_path_is_fine(da_settings: Any, value: str) -> None:
    da_settings(SITE_URL=value)
    assert da_checks.check_settings() == []


# -- irreversible calls that may outlast the shutdown grace (W008) -------------------------


def _warnings_for(tool_name: str) -> list[checks.CheckMessage]:
    return [m for m in da_checks.check_shutdown_grace() if f"'{tool_name}'" in m.msg]


def test_an_irreversible_tool_that_may_outlast_the_shutdown_grace_warns(
    settings: Any, da_settings: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    settings.SILENCED_SYSTEM_CHECKS = []  # the test settings silence it for the test app

    @tool(effect="irreversible")
    def launch_rocket(pad: str) -> str:
        """Launch a rocket."""
        return pad

    @tool(effect="irreversible", timeout=5)
    def quick_launch(pad: str) -> str:
        """Launch a small rocket."""
        return pad

    agent = Agent(
        name="launcher",
        version="v1",
        model="claude-x",
        system="s",
        tools=[launch_rocket, quick_launch],
    )
    try:
        da_settings(SHUTDOWN_GRACE_SECONDS=10, TOOL_TIMEOUT=600)
        [warning] = _warnings_for("launch_rocket")
        assert warning.id == "durable_agents.W008" == da_checks.IRREVERSIBLE_OUTLASTS_GRACE
        # The tool, its agent and both numbers; what to do.
        assert "launcher@v1" in warning.msg
        assert "600s" in warning.msg
        assert "SHUTDOWN_GRACE_SECONDS (10s)" in warning.msg
        assert warning.hint is not None
        assert "timeout=10" in warning.hint
        assert "at least 600" in warning.hint
        assert str(warning).startswith("tests.unit.test_checks.")  # named by its dotted path
        assert _warnings_for("quick_launch") == []  # its timeout fits in the grace
        call_command("check")
        assert "durable_agents.W008" in capsys.readouterr().err
        # A grace that covers the timeout, or a timeout within the grace, is quiet.
        da_settings(SHUTDOWN_GRACE_SECONDS=600)
        assert _warnings_for("launch_rocket") == []
        da_settings(SHUTDOWN_GRACE_SECONDS=10, TOOL_TIMEOUT=8)
        assert _warnings_for("launch_rocket") == []
    finally:
        registry.unregister(agent.name, agent.version)
