"""Text from outside (a tool's exception, the model's text, event and tool names) never forges
a line of the app's log: control characters are escaped in the app's records, in their
message and in their exception's traceback alike."""

from __future__ import annotations

import io
import logging
import logging.handlers
from collections.abc import Iterator

import pytest

from durable_agents import api, tool
from durable_agents.declare.agents import Agent
from durable_agents.logging import EscapeControlsFilter, escape_controls
from durable_agents.models import AgentRun, RunStatus
from tests.conftest import run_worker

pytestmark = pytest.mark.django_db(transaction=True)

FORGED = "x\nINFO run 123 succeeded"


@tool(effect="pure")
def forge(text: str) -> str:
    """Fails with the text it is given."""
    raise ValueError(text)


forger = Agent(
    name="log_forger",
    version="v1",
    model="claude-test-1",
    system="You forge log lines.",
    tools=[forge],
    max_tokens=256,
)


@pytest.fixture
def app_log() -> Iterator[io.StringIO]:
    """Everything the app logs, formatted one record after another as a log file holds it."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s %(message)s"))
    app = logging.getLogger("durable_agents")
    level = app.level
    app.addHandler(handler)
    app.setLevel(logging.DEBUG)  # a tool's traceback is logged at DEBUG
    yield stream
    app.removeHandler(handler)
    app.setLevel(level)


def test_a_tool_exception_cannot_forge_a_log_line(app_log: io.StringIO) -> None:
    run = api.start_run("log_forger", '@forge {"text": "x\\nINFO run 123 succeeded"}')
    run_worker()
    assert AgentRun.objects.get(pk=run.pk).status == RunStatus.SUCCEEDED
    lines = app_log.getvalue().splitlines()
    assert not [line for line in lines if line.startswith("INFO run 123")]
    [raised] = [
        line for line in lines if line.startswith("WARNING") and "tool forge raised" in line
    ]
    assert raised.endswith("x\\nINFO run 123 succeeded")
    # The traceback's last line names the exception with its message escaped, on one line.
    assert "ValueError: x\\nINFO run 123 succeeded" in lines


def test_the_filter_escapes_records_of_other_loggers() -> None:
    record = logging.LogRecord("tool.code", logging.INFO, __file__, 1, "said %s", (FORGED,), None)
    assert EscapeControlsFilter().filter(record)
    assert record.getMessage() == "said x\\nINFO run 123 succeeded"
    assert record.msg == "said %s"  # the template is kept, for handlers that group by it
    # A record that crosses processes is pickled: nothing unpicklable was added to it.
    assert logging.handlers.SocketHandler("localhost", None).makePickle(record)


def test_escape_controls_keeps_tabs_and_escapes_the_rest() -> None:
    assert escape_controls("a\tb\r\nc\x1b[2J\u2028") == "a\tb\\r\\nc\\x1b[2J\\u2028"


# -- a tool's error, which the model is told about -----------------------------------------


def tool_error_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if "tool forge raised" in r.getMessage()]


def test_a_tool_error_is_one_warning_line_without_its_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="durable_agents")
    run = api.start_run("log_forger", '@forge {"text": "the disk is full"}')
    run_worker()
    assert AgentRun.objects.get(pk=run.pk).status == RunStatus.SUCCEEDED  # the model was told
    [warning] = tool_error_records(caplog)
    assert warning.levelno == logging.WARNING
    assert warning.exc_info is None
    message = warning.getMessage()
    assert str(run.pk) in message  # which run
    assert "ValueError: the disk is full" in message  # the exception's type and message
    assert "Traceback" not in caplog.text
    assert not [r for r in caplog.records if r.exc_info]


def test_a_tool_error_keeps_its_traceback_at_debug(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="durable_agents")
    run = api.start_run("log_forger", '@forge {"text": "the disk is full"}')
    run_worker()
    [warning, traceback] = tool_error_records(caplog)
    assert (warning.levelno, warning.exc_info) == (logging.WARNING, None)
    assert traceback.levelno == logging.DEBUG
    assert traceback.exc_info is not None
    assert str(run.pk) in traceback.getMessage()
    formatted = logging.Formatter().format(traceback)
    assert "raise ValueError(text)" in formatted  # the tool's own line
    assert formatted.rstrip().endswith("ValueError: the disk is full")


def test_a_long_tool_error_is_cut_in_its_warning_line(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="durable_agents")
    api.start_run("log_forger", '@forge {"text": "' + "x" * 20_000 + '"}')
    run_worker()
    [warning] = tool_error_records(caplog)
    message = warning.getMessage()
    assert len(message) < 1_000, len(message)
    assert "20000 characters in all" in message
