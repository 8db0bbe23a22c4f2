r"""The script language of the offline model.

The script lives in the task (the text of the first user message). Lines starting with ``@`` are
plan lines, one per model turn; the calls of one turn are separated by `` && ``::

    Migrate the orders table.
    @get_schema {"table": "orders"}
    @get_schema {"table": "orders"} && set_status {"ticket": "T-1", "status": "done"}
    @@latency 0.25          (seconds before each answer)
    @@chunk_latency 0.1     (seconds between the events of a streamed answer)

Turn k (= number of assistant messages already sent) plays plan line k; past the last plan line
the model ends the run with ``end_turn``.

Two directives let a script play a hostile provider, whatever the names, inputs and texts (the
values are JSON, so NUL and lone surrogates are written as the escapes ``\u0000``, ``\ud800``)::

    @@turn [{"name": "lookup", "input": {"key": "a\u0000"}}, {"name": "\ud800", "input": []}]
    @@final "Done \u0000 \udfff"

``@@turn`` is a plan line (one turn, in order with the ``@`` lines) whose calls are a JSON array
of objects with a string ``name`` and any JSON ``input`` (``{}`` when left out). ``@@final``
sets the text of the final (``end_turn``) turn; the last one given wins. ``turn_directive`` and
``final_directive`` write these lines. Inputs may nest deeper than Python's recursion limit
(``loads_deep`` / ``dumps_deep`` handle any depth), and a response whose values hold lone
surrogates is sent with those escaped (``\ud800``), as valid UTF-8 JSON text: what a real
hostile provider response would contain.

``@@answer "text"`` is a plan line too: a final (``end_turn``) turn with that text, in order
with the other plan lines. When the run goes on after it (the runtime refused the answer and
said why in a user message), the next turn plays the next plan line::

    @@answer "{\"total\": \"twelve\"}"
    @@answer "{\"total\": 12}"

``@@repeat N <plan line>`` is N plan lines at once (``@@repeat 4999 @noop {"key": "k"}``): a
long run's script stays short.

``@@stop_on_error``: when a tool result the model reads last is an error (``is_error``), the
model stops there, with a final turn that says which call failed, instead of going on with the
plan. A fork of the run at that step with the result edited goes on with the plan.
"""

from __future__ import annotations

from typing import Any

from durable_agents._internal.deepjson import dumps_deep, loads_deep, raw_decode_deep
from durable_agents.offline.wire import RequestError, invalid

LATENCY_DIRECTIVE = "latency"
# Seconds between two events of a streamed answer (``@@chunk_latency 0.2``).
CHUNK_LATENCY_DIRECTIVE = "chunk_latency"
# A plan line given as JSON (``@@turn [{"name": ..., "input": ...}]``) and the final text.
TURN_DIRECTIVE = "turn"
FINAL_DIRECTIVE = "final"
# A plan line that is a final turn with the given text (``@@answer "..."``).
ANSWER_DIRECTIVE = "answer"
CALL_SEPARATOR = " && "
# ``@@repeat N <plan line>``: N plan lines at once.
REPEAT_DIRECTIVE = "repeat"
# ``@@stop_on_error``: an error result ends the run rather than the plan going on.
STOP_ON_ERROR_DIRECTIVE = "stop_on_error"
MAX_REPEAT = 1_000_000


def turn_directive(calls: list[tuple[str, Any]]) -> str:
    """The ``@@turn`` line of one turn making ``calls`` ((name, input) pairs), all ASCII."""
    return f"@@{TURN_DIRECTIVE} " + dumps_deep(
        [{"name": name, "input": tool_input} for name, tool_input in calls]
    )


def answer_directive(text: str) -> str:
    """The ``@@answer`` plan line of a final turn whose text is ``text``, all ASCII."""
    return f"@@{ANSWER_DIRECTIVE} " + dumps_deep(text)


def final_directive(text: str) -> str:
    """The ``@@final`` line that makes ``text`` the final turn's text, all ASCII."""
    return f"@@{FINAL_DIRECTIVE} " + dumps_deep(text)


class PlanCall:
    """One tool call of a plan line: the name as written and the input as written."""

    __slots__ = ("input", "name")

    def __init__(self, name: str, input: Any) -> None:  # ``input``: mirrors the API field
        self.name = name
        self.input = input

    def __repr__(self) -> str:
        return f"PlanCall({self.name!r}, {self.input!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PlanCall) and (self.name, self.input) == (other.name, other.input)

    __hash__ = None  # type: ignore[assignment]  # input may be unhashable


class Script:
    """The parsed task: plan lines (one list of calls per turn), latency, first line, and the
    final turn's text when ``@@final`` sets it."""

    def __init__(
        self,
        first_line: str,
        plan: list[list[PlanCall]],
        latency: float,
        chunk_latency: float = 0.0,
        final_text: str | None = None,
        stop_on_error: bool = False,
        answers: dict[int, str] | None = None,
    ) -> None:
        self.first_line = first_line
        self.plan = plan
        self.latency = latency
        self.chunk_latency = chunk_latency
        self.final_text = final_text
        self.stop_on_error = stop_on_error
        # Plan lines that are final turns (``@@answer``): their index, and the turn's text.
        self.answers: dict[int, str] = answers or {}


def _parse_call_args(text: str) -> tuple[Any, str | None]:
    """Parse the arguments at the start of ``text`` (what follows a tool name).

    Returns (input, rest): rest is the text after the next `` && ``, or None at the end of the
    line. A JSON value is read with raw_decode so that a JSON string may itself contain
    `` && ``; text that is not valid JSON (up to the next separator) becomes ``{"_raw": text}``.
    """
    stripped = text.strip()
    if not stripped:
        return {}, None
    if stripped.startswith("&&"):
        return {}, stripped[2:]
    try:
        value, end = raw_decode_deep(stripped)  # at any depth
    except ValueError:
        pass
    else:
        tail = stripped[end:]
        if not tail.strip():
            return value, None
        if tail.startswith(CALL_SEPARATOR):
            return value, tail[len(CALL_SEPARATOR) :]
    raw, sep, rest = stripped.partition(CALL_SEPARATOR)
    return {"_raw": raw.strip()}, (rest if sep else None)


def _parse_plan_line(line: str, number: int) -> list[PlanCall]:
    calls: list[PlanCall] = []
    rest: str | None = line[1:]
    while rest is not None:
        rest = rest.lstrip()
        name_end = next((i for i, ch in enumerate(rest) if ch.isspace()), len(rest))
        name = rest[:name_end]
        if not name or name == "&&":
            raise invalid(f"offline script: plan line {number} has a call without a tool name")
        tool_input, rest = _parse_call_args(rest[name_end:])
        calls.append(PlanCall(name, tool_input))
    return calls


def parse_script(task: str) -> Script:
    """Parse a task into its script. Raises ValueError on a malformed directive or plan line."""
    try:
        return script_of(task)
    except RequestError as e:
        raise ValueError(e.message) from None


def _parse_turn_directive(value: str, number: int) -> list[PlanCall]:
    """The calls of a ``@@turn`` line: a JSON array of {"name": str, "input": any}."""
    where = f"offline script: @@{TURN_DIRECTIVE} (plan line {number})"
    try:
        calls = loads_deep(value)
    except ValueError as e:
        raise invalid(f"{where} needs a JSON array of calls: {e}") from None
    if not isinstance(calls, list) or not calls:
        raise invalid(f"{where} needs a non-empty JSON array of calls")
    plan_calls = []
    for call in calls:
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            raise invalid(f"{where}: each call is an object with a string `name`")
        plan_calls.append(PlanCall(call["name"], call.get("input", {})))
    return plan_calls


def _parse_final_directive(value: str, directive: str = FINAL_DIRECTIVE) -> str:
    try:
        text = loads_deep(value)
    except ValueError as e:
        raise invalid(f"offline script: @@{directive} needs a JSON string: {e}") from None
    if not isinstance(text, str):
        raise invalid(f"offline script: @@{directive} needs a JSON string")
    return text


def _parse_repeat_directive(value: str, number: int) -> tuple[int, list[PlanCall]]:
    """``@@repeat N <plan line>``: how many times, and the calls of the plan line."""
    where = f"offline script: @@{REPEAT_DIRECTIVE} (plan line {number})"
    count, _, line = value.strip().partition(" ")
    try:
        times = int(count)
    except ValueError:
        times = 0
    if not 1 <= times <= MAX_REPEAT:
        raise invalid(f"{where} needs a count from 1 to {MAX_REPEAT}, got {count!r}")
    line = line.strip()
    if line.startswith(f"@@{TURN_DIRECTIVE} "):
        return times, _parse_turn_directive(line[len(TURN_DIRECTIVE) + 3 :], number)
    if not line.startswith("@") or line.startswith("@@"):
        raise invalid(f"{where} needs a plan line after the count (@tool {{...}})")
    return times, _parse_plan_line(line, number)


def prose_of(task: str) -> str:
    """The task as a person would write it: its text without the plan lines and directives
    (the lines that start with ``@``), for a page that shows what a run was asked. The task
    itself, which the model reads, is never changed."""
    lines = [line for line in task.splitlines() if not line.strip().startswith("@")]
    return "\n".join(lines).strip()


def script_of(task: str) -> Script:
    """The script of ``task``; a malformed directive or plan line is the 400 the model answers
    (``parse_script`` says it as a ValueError instead)."""
    lines = task.splitlines()
    first_line = next((ln.strip() for ln in lines if ln.strip()), "")
    plan: list[list[PlanCall]] = []
    delays = {LATENCY_DIRECTIVE: 0.0, CHUNK_LATENCY_DIRECTIVE: 0.0}
    final_text: str | None = None
    stop_on_error = False
    answers: dict[int, str] = {}
    for raw_line in lines:
        line = raw_line.strip()
        if line.startswith("@@"):
            directive, _, value = line[2:].partition(" ")
            if directive == TURN_DIRECTIVE:
                plan.append(_parse_turn_directive(value, len(plan)))
                continue
            if directive == FINAL_DIRECTIVE:
                final_text = _parse_final_directive(value)
                continue
            if directive == ANSWER_DIRECTIVE:
                answers[len(plan)] = _parse_final_directive(value, ANSWER_DIRECTIVE)
                plan.append([])
                continue
            if directive == STOP_ON_ERROR_DIRECTIVE and not value.strip():
                stop_on_error = True
                continue
            if directive == REPEAT_DIRECTIVE:
                times, calls = _parse_repeat_directive(value, len(plan))
                plan.extend([calls] * times)
                continue
            if directive not in delays:
                raise invalid(f"offline script: unknown directive @@{directive}")
            try:
                seconds = float(value)
            except ValueError:
                raise invalid(
                    f"offline script: @@{directive} needs seconds, got {value!r}"
                ) from None
            if not seconds >= 0:  # also rejects nan
                raise invalid(f"offline script: @@{directive} must be >= 0")
            delays[directive] = seconds
        elif line.startswith("@"):
            plan.append(_parse_plan_line(line, len(plan)))
    return Script(
        first_line,
        plan,
        delays[LATENCY_DIRECTIVE],
        delays[CHUNK_LATENCY_DIRECTIVE],
        final_text,
        stop_on_error,
        answers,
    )
