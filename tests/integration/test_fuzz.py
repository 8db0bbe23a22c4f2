"""A property-based fuzz suite of hostile model turns and tool results.

Hypothesis generates model turns (tool names, inputs, the final text; NUL, lone surrogates,
nesting far past any recursion limit, sizes up to a few MB) and the values the tools give back
(chosen by the inputs of the ``fuzzer`` agent's tools, tests/testapp/fuzz_agents.py). The
offline model plays them (``@@turn`` / ``@@final`` directives, durable_agents/offline/script.py),
in-process burst workers advance each run one claim at a time, and for every example:

(a) within MAX_ATTEMPTS + 1 claims the run is terminal (succeeded, failed, cancelled, dead) or
    waiting (on an intent: a valid outcome of an irreversible call);
(b) the admin run page answers 200 with a UTF-8 body;
(c) nothing is lost from the step log: seqs contiguous from 0, ``last_seq`` is the last seq,
    every model turn is byte for byte a body the offline model sent, every call of a turn
    followed by a tool_result step has its result block, and ``messages_for`` works.

Examples: 60 on PostgreSQL and 40 on SQLite in ``make test`` (the short profile), 500 and 150
in ``make test-long`` (``DA_FUZZ=long``), each split between two test functions that xdist
runs side by side; ``DA_FUZZ_EXAMPLES`` sets the number of each.
Derandomized when ``CI`` is set, so CI runs the same examples every time. The focused tests
at the end pin concrete hostile inputs (NUL, lone surrogates, deep nesting, exits).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import anthropic
import pytest
from django.conf import settings as django_settings
from django.test import Client
from hypothesis import HealthCheck, given, note
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument

import durable_agents
from durable_agents._internal.text import (
    NUL_MARKER,
    SURROGATE_MARKER,
    has_unstorable,
    storable_text,
)
from durable_agents.engine.worker import Worker
from durable_agents.models import AgentRun, AgentStep, ToolEffect, ToolIntent
from durable_agents.offline import (
    ScriptedModel,
    dumps_deep,
    final_directive,
    loads_deep,
    offline_client,
    turn_directive,
)
from tests.testapp.fuzz_agents import BUILD_KINDS, EXCEPTION_NAMES, FUZZ_TOOL_NAMES

pytestmark = pytest.mark.django_db(transaction=True)

ON_POSTGRES = django_settings.DATABASES["default"]["ENGINE"] == "django.db.backends.postgresql"

# Small, so a run that keeps failing reaches the dead letter in a few fast claims.
MAX_ATTEMPTS = 2
CLAIM_LIMIT = MAX_ATTEMPTS + 1
SETTLED = frozenset({"succeeded", "failed", "cancelled", "dead", "waiting"})
TERMINAL = frozenset({"succeeded", "failed", "cancelled", "dead"})
TITLE = "Fuzz example: play the plan."


# --------------------------------------------------------------------------- hypothesis profiles

_COMMON: dict[str, Any] = {
    "deadline": None,
    "database": None,  # examples are generated afresh (or derandomized), never replayed
    "suppress_health_check": [
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
    ],
    "derandomize": bool(os.environ.get("CI")),
    "print_blob": True,
}
# The short profiles keep `make test` in minutes; the long ones are `make test-long`'s.
# SQLite serialises writers; fewer examples keep its run short (the logic is the same).
for _length, _postgresql, _sqlite in (("short", 60, 40), ("long", 500, 150)):
    hypothesis_settings.register_profile(
        f"durable_agents_fuzz_{_length}_postgresql", max_examples=_postgresql, **_COMMON
    )
    hypothesis_settings.register_profile(
        f"durable_agents_fuzz_{_length}_sqlite", max_examples=_sqlite, **_COMMON
    )


# The examples are split between HALVES test functions (each derandomized by its own name, so
# they play different examples), which pytest-xdist runs side by side: each stays well inside
# the time a test of the default run may take.
HALVES = 2


def fuzz_profile() -> hypothesis_settings:
    """The profile of this database and length (``DA_FUZZ=long``: the long one), for one of
    the HALVES fuzz tests; ``DA_FUZZ_EXAMPLES`` sets the number of examples of each."""
    length = "long" if os.environ.get("DA_FUZZ") == "long" else "short"
    name = f"durable_agents_fuzz_{length}_" + ("postgresql" if ON_POSTGRES else "sqlite")
    profile = hypothesis_settings.get_profile(name)
    examples = os.environ.get("DA_FUZZ_EXAMPLES")
    if examples:
        return hypothesis_settings(profile, max_examples=int(examples))
    return hypothesis_settings(profile, max_examples=max(1, profile.max_examples // HALVES))


# --------------------------------------------------------------------------- recording model


class RecordingModel(ScriptedModel):
    """The offline model, keeping every 200 body it sent: a stored model turn must be one of
    them, byte for byte."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self.sent: list[str] = []

    def respond(
        self, method: str, path: str, headers: Any, body: bytes
    ) -> tuple[int, dict[str, str], bytes]:
        status, out_headers, out = super().respond(method, path, headers, body)
        if status == 200:
            with self._lock:
                # The body must be UTF-8 (the offline model escapes lone surrogates).
                self.sent.append(out.decode("utf-8"))
        return status, out_headers, out

    def clear(self) -> None:
        with self._lock:
            self.sent.clear()


RECORDER = RecordingModel()


def recording_client() -> anthropic.Anthropic:
    """CLIENT_FACTORY of this suite: the real SDK in front of ``RECORDER``."""
    return offline_client(scripted=RECORDER)


# --------------------------------------------------------------------------- one claim at a time


class OneClaimWorker(Worker):
    """A burst worker for one claim that returns as soon as its slot is done.

    ``Worker.run`` checks its slots every 0.1 s; at three claims an example that would be most of
    the suite's time. Setting ``stopping`` when the slot returns ends the wait at once (a slot
    that returns holds no run, so the drain that follows has nothing to do)."""

    def __init__(self) -> None:
        super().__init__(
            worker_id="fuzz-worker", burst=True, max_runs=1, handle_signals=False, concurrency=1
        )

    def _slot(self) -> None:
        try:
            super()._slot()
        finally:
            self.stopping.set()


def one_claim() -> int:
    """Let one in-process worker claim (at most) one run; returns how many it claimed."""
    worker = (
        OneClaimWorker()
        if hasattr(Worker, "_slot")
        else Worker(burst=True, max_runs=1, handle_signals=False)
    )
    worker.run()
    return worker.stats.claims


def settle(run_id: Any) -> tuple[AgentRun, int]:
    """Advance the run one claim at a time until it is terminal or waiting, at most
    CLAIM_LIMIT claims. Fails at once when a run that is neither cannot be claimed: no worker
    would ever move it again (its lease held by a slot that died, for instance)."""
    claims = 0
    while True:
        run = AgentRun.objects.get(pk=run_id)
        if run.status in SETTLED or claims >= CLAIM_LIMIT:
            return run, claims
        claimed = one_claim()
        if claimed == 0:
            run = AgentRun.objects.get(pk=run_id)
            if run.status in SETTLED:
                return run, claims
            raise AssertionError(
                f"run is {run.status!r} after {claims} claim(s) and no worker can claim it: "
                f"lease_owner={run.lease_owner!r} lease_until={run.lease_until} "
                f"error={run.error[:500]!r}"
            )
        claims += claimed


# --------------------------------------------------------------------------- the properties


def same_json(a: Any, b: Any) -> bool:
    """Equality of two JSON values at any depth (``==`` recurses), key order ignored (the
    database may reorder keys)."""
    return dumps_deep(a, sort_keys=True) == dumps_deep(b, sort_keys=True)


def tool_uses(turn: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        b for b in turn.get("content") or [] if isinstance(b, dict) and b.get("type") == "tool_use"
    ]


def check_settled(run: AgentRun, claims: int) -> None:
    """Property (a)."""
    assert run.status in SETTLED, (
        f"run still {run.status!r} after {claims} claims (limit {CLAIM_LIMIT}); "
        f"error={run.error[:500]!r}"
    )


def check_admin_page(client: Client, run: AgentRun) -> None:
    """Property (b)."""
    response = client.get(f"/admin/durable_agents/agentrun/{run.pk}/change/")
    assert response.status_code == 200, response.status_code
    response.content.decode("utf-8")  # raises if the page is not UTF-8


def check_step_log(run: AgentRun, sent: list[str], final_text: str | None = None) -> None:
    """Property (c), plus what a finished or waiting run must show."""
    steps = list(AgentStep.objects.filter(run_id=run.pk).order_by("seq"))
    seqs = [step.seq for step in steps]
    assert seqs == list(range(len(steps))), f"seqs are not contiguous from 0: {seqs}"
    assert steps
    assert steps[0].kind == "task"
    assert run.last_seq == seqs[-1], (run.last_seq, seqs[-1])

    sent_bodies = set(sent)
    parsed: list[Any] = []
    for step in steps:
        assert isinstance(step.payload, str)
        assert not has_unstorable(step.payload), f"seq {step.seq}: unstorable text stored"
        data = loads_deep(step.payload)  # valid JSON text
        parsed.append(data)
        if step.kind == "model_turn":
            assert step.payload in sent_bodies, (
                f"seq {step.seq}: the stored model turn is not a body the model sent "
                f"({len(step.payload)} chars: {step.payload[:300]!r})"
            )
    for index, step in enumerate(steps):
        if step.kind == "tool_result":
            previous = parsed[index - 1]
            assert steps[index - 1].kind == "model_turn", f"seq {step.seq} follows no turn"
            assert isinstance(parsed[index], list)
            answered = {b.get("tool_use_id") for b in parsed[index] if isinstance(b, dict)}
            for call in tool_uses(previous):
                assert call.get("id") in answered, (
                    f"seq {step.seq}: no tool_result for call {call.get('id')} "
                    f"({str(call.get('name'))[:80]!r}) of seq {step.seq - 1}"
                )
    durable_agents.messages_for(run.pk)  # the history rebuilds

    if run.status == "succeeded":
        assert steps[-1].kind == "model_turn"
        assert parsed[-1].get("stop_reason") == "end_turn"
        assert run.result is not None
        assert not has_unstorable(run.result)
        if final_text is not None and len(final_text) <= 10_000:
            # What the body carries: in JSON, the escapes of a surrogate pair ("\ud800\udc00")
            # are one character (U+10000); only lone surrogates get the marker.
            assert run.result == storable_text(loads_deep(dumps_deep(final_text)))
    if run.status == "waiting":
        # On a person: an intent that waits, whose input is exactly what the model asked for.
        intents = list(ToolIntent.objects.filter(run_id=run.pk))
        assert intents, "a waiting run without an intent"
        by_seq = {step.seq: data for step, data in zip(steps, parsed, strict=True)}
        for intent in intents:
            call = tool_uses(by_seq[intent.seq])[intent.call_index]
            assert intent.tool == call["name"]
            assert same_json(intent.input, call["input"]), "intent input does not round-trip"


# --------------------------------------------------------------------------- test plumbing


@dataclass
class Fuzz:
    client: Client
    recorder: RecordingModel

    def play(
        self, agent: str, turns: list[list[tuple[str, Any]]], final: str | None
    ) -> tuple[AgentRun, int, list[str]]:
        """Start a run of the plan and settle it; returns (run, claims, the properties that do
        not hold). Every property is checked, so one report names all that is broken."""
        self.recorder.clear()
        run = durable_agents.start_run(agent, task_text(turns, final))
        run, claims = settle(run.pk)
        say(f"run {run.pk}: {run.status} after {claims} claims; error={run.error[:300]!r}")
        checks: list[tuple[str, Callable[[], None]]] = [
            ("(a) settled", lambda: check_settled(run, claims)),
            ("(b) admin page", lambda: check_admin_page(self.client, run)),
            ("(c) step log", lambda: check_step_log(run, self.recorder.sent, final)),
        ]
        broken = []
        for name, check in checks:
            try:
                check()
            except Exception as exc:  # noqa: BLE001 - reported, with the others, by the caller
                broken.append(f"{name}: {type(exc).__name__}: {str(exc)[:1000]}")
        return run, claims, broken

    def play_checked(
        self, agent: str, turns: list[list[tuple[str, Any]]], final: str | None
    ) -> tuple[AgentRun, int]:
        run, claims, broken = self.play(agent, turns, final)
        if broken:
            # One exception type per first broken property: hypothesis shrinks and reports
            # each kind of failure separately instead of folding them into one.
            kind = PROPERTY_ERRORS[broken[0][:3]]
            raise kind("\n".join(broken))
        return run, claims


class NotSettled(AssertionError):
    """(a) does not hold."""


class AdminPageBroken(AssertionError):
    """(b) does not hold (and (a) does)."""


class StepLogBroken(AssertionError):
    """(c) does not hold (and (a), (b) do)."""


PROPERTY_ERRORS: dict[str, type[AssertionError]] = {
    "(a)": NotSettled,
    "(b)": AdminPageBroken,
    "(c)": StepLogBroken,
}


def say(text: str) -> None:
    """A note on the failing example's report (outside hypothesis, in the focused tests,
    the assertion messages say enough)."""
    with contextlib.suppress(InvalidArgument):
        note(text)


def task_text(turns: list[list[tuple[str, Any]]], final: str | None) -> str:
    lines = [TITLE, *(turn_directive(calls) for calls in turns)]
    if final is not None:
        lines.append(final_directive(final))
    return "\n".join(lines)


def clean_database() -> None:
    # Examples must be independent: each starts with no run (cascades to steps and intents).
    ToolEffect.objects.all().delete()
    ToolIntent.objects.all().delete()
    AgentStep.objects.all().delete()
    AgentRun.objects.all().delete()


@pytest.fixture
def fuzz(da_settings: Callable[..., None], django_user_model: Any) -> Iterator[Fuzz]:
    da_settings(
        MAX_ATTEMPTS=MAX_ATTEMPTS,
        # A failed model call is handed back at once: MAX_ATTEMPTS bounds it, not backoff sleeps.
        MODEL_RETRIES=0,
        OFFLINE=True,
        CLIENT_FACTORY=f"{__name__}.recording_client",
    )
    user = django_user_model.objects.create_superuser("fuzz-admin", "fuzz@example.com", "pw")
    client = Client()
    client.force_login(user)
    yield Fuzz(client, RECORDER)
    RECORDER.clear()


# --------------------------------------------------------------------------- strategies

# Characters that break things: NUL, lone surrogates of both halves, separators that
# str.splitlines() splits on, a BOM, right-to-left override, a character outside the BMP.
SPECIALS = ["\x00", "\ud800", "\udfff", "\udc00", "\u2028", "\x85", "\x1e", "\ufeff", "\u202e"]
SPECIALS += ["\U0001f600", "\n", "\r", '"', "\\", "&&", " && ", "@", "@@"]


def weighted(*options: tuple[int, st.SearchStrategy[Any]]) -> st.SearchStrategy[Any]:
    """One of ``options`` by weight; shrinks toward the first (make it the common one)."""
    total = sum(weight for weight, _ in options)

    def pick(roll: int) -> st.SearchStrategy[Any]:
        for weight, strategy in options:
            if roll < weight:
                return strategy
            roll -= weight
        raise AssertionError("unreachable")

    return st.integers(0, total - 1).flatmap(pick)


# Any code point, lone surrogates included (hypothesis leaves category Cs out by default).
hostile_pieces = st.one_of(st.characters(exclude_categories=()), st.sampled_from(SPECIALS))


def short_texts(max_size: int = 30) -> st.SearchStrategy[str]:
    return st.lists(hostile_pieces, max_size=max_size).map("".join)


def huge_text(size: int, piece: str) -> str:
    return (piece * (size // len(piece) + 1))[:size]


# Huge strings are rare: a 3 MB one crosses every layer (task, body, payload, admin page).
huge_texts = st.builds(
    huge_text,
    weighted(
        (8, st.sampled_from([10_000, 70_000])),
        (3, st.sampled_from([300_000, 1_000_000])),
        (1, st.just(3_000_000)),
    ),
    st.sampled_from(["x", "a\x00b\ud800", "\U0001f600\udfff"]),
)
texts = weighted((40, short_texts()), (1, huge_texts))

depths = st.sampled_from([2, 50, 99, 100, 101, 500, 999, 1000, 1001, 3000, 3500])


def deep_value(depth: int, container: str, leaf: Any) -> Any:
    value = leaf
    for _ in range(depth):
        value = [value] if container == "list" else {"k\x00": value}
    return value


deep_values = st.builds(deep_value, depths, st.sampled_from(["list", "dict"]), short_texts(5))

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.sampled_from([10**30, -(10**30), 2**63]),
    st.floats(allow_nan=False, allow_infinity=False),
    short_texts(),
)
json_values = st.recursive(
    scalars,
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(short_texts(8), children, max_size=3)
    ),
    max_leaves=8,
)
values = weighted((20, json_values), (4, deep_values), (1, huge_texts))

names = weighted(
    (12, st.sampled_from(FUZZ_TOOL_NAMES)),
    (2, st.sampled_from(["unknown_tool", "lookup", "ask_person", "ECHO", "echo ", " echo"])),
    (2, st.sampled_from(FUZZ_TOOL_NAMES).map(lambda name: name + "\x00")),
    (2, st.sampled_from(FUZZ_TOOL_NAMES).map(lambda name: name + "\ud800")),
    (2, short_texts(12)),
    (1, st.just("")),
    (1, st.integers(129, 20_000).map(lambda n: "n" * n)),
)

# Inputs that no schema accepts: not an object, missing or extra keys.
wrong_inputs = st.one_of(
    json_values.filter(lambda v: not isinstance(v, dict)),
    st.just({}),
    st.dictionaries(short_texts(8), json_values, max_size=3),
    deep_values,
)
sizes = weighted(
    (12, st.integers(0, 64)),
    (4, st.sampled_from([99, 100, 101, 1000, 3000, 5000])),
    (1, st.sampled_from([200_000, 1_000_000])),
    (1, st.sampled_from([-1, 10**12])),
)


def inputs_for(name: str) -> st.SearchStrategy[Any]:
    """Inputs a tool of this name is likely to accept (a hostile value inside)."""
    if name == "build":
        return st.fixed_dictionaries(
            {"kind": st.sampled_from(BUILD_KINDS), "size": sizes},
            optional={"text": short_texts()},
        )
    if name == "fail":
        return st.fixed_dictionaries(
            {"exc": st.sampled_from(EXCEPTION_NAMES)}, optional={"message": texts}
        )
    if name in FUZZ_TOOL_NAMES:
        return st.fixed_dictionaries({"value": values})
    return values


@st.composite
def calls(draw: st.DrawFn) -> tuple[str, Any]:
    name = draw(names)
    tool_input = draw(weighted((6, inputs_for(name)), (1, wrong_inputs)))
    return name, tool_input


turns = st.lists(st.lists(calls(), min_size=1, max_size=3), max_size=4)
finals = weighted((6, st.none()), (12, short_texts(40)), (1, huge_texts))
agents = st.sampled_from(["fuzzer", "fuzzer", "fuzz_thinker"])


# --------------------------------------------------------------------------- the fuzz test


def play_example(
    fuzz: Fuzz, agent: str, plan: list[list[tuple[str, Any]]], final: str | None
) -> None:
    try:
        fuzz.play_checked(agent, plan, final)
    finally:
        clean_database()


@fuzz_profile()
@given(agent=agents, plan=turns, final=finals)
def test_hostile_turns_settle_and_lose_nothing(
    fuzz: Fuzz, agent: str, plan: list[list[tuple[str, Any]]], final: str | None
) -> None:
    play_example(fuzz, agent, plan, final)


@fuzz_profile()
@given(agent=agents, plan=turns, final=finals)
def test_more_hostile_turns_settle_and_lose_nothing(
    fuzz: Fuzz, agent: str, plan: list[list[tuple[str, Any]]], final: str | None
) -> None:
    """The other half of the examples (other ones: derandomized by this test's name)."""
    play_example(fuzz, agent, plan, final)


# --------------------------------------------------------------------------- focused regressions
# Each asserts the outcome a user expects first (the run goes on, the model is told), then the
# three properties of the fuzz test.


def tool_results(run: AgentRun) -> list[dict[str, Any]]:
    """Every tool_result block of the run, in order."""
    blocks: list[dict[str, Any]] = []
    for step in AgentStep.objects.filter(run_id=run.pk, kind="tool_result").order_by("seq"):
        blocks.extend(loads_deep(step.payload))
    return blocks


def assert_model_told(run: AgentRun, claims: int) -> dict[str, Any]:
    """The model saw one tool_result with is_error and the run went on to succeed."""
    assert run.status == "succeeded", (run.status, claims, run.error[:500])
    results = tool_results(run)
    assert len(results) == 1, results
    assert results[0].get("is_error") is True, results[0]
    return results[0]


def test_tool_name_with_nul(fuzz: Fuzz) -> None:
    run, claims, broken = fuzz.play("fuzzer", [[("echo\x00", {"value": "x"})]], "ok")
    result = assert_model_told(run, claims)
    assert "unknown tool" in result["content"]
    # The name is shown (with a marker or escaped), never as a raw NUL.
    assert not has_unstorable(result["content"]), result["content"]
    assert not broken, "\n".join(broken)


def test_tool_name_with_lone_surrogate(fuzz: Fuzz) -> None:
    run, claims, broken = fuzz.play("fuzzer", [[("echo\ud800", {"value": "x"})]], "ok")
    result = assert_model_told(run, claims)
    assert "unknown tool" in result["content"]
    assert not has_unstorable(result["content"]), result["content"]
    assert not broken, "\n".join(broken)


def test_nul_and_lone_surrogate_in_final_text(fuzz: Fuzz) -> None:
    run, _, broken = fuzz.play("fuzzer", [], "before\x00middle\ud800after")
    assert run.status == "succeeded", (run.status, run.error[:500])
    assert run.result == f"before{NUL_MARKER}middle{SURROGATE_MARKER}after"
    assert not broken, "\n".join(broken)


@pytest.mark.parametrize("container", ["list", "dict"])
def test_tool_input_3000_deep(fuzz: Fuzz, container: str) -> None:
    deep = deep_value(3000, container, "leaf")
    run, claims, broken = fuzz.play("fuzzer", [[("echo", {"value": deep})]], "ok")
    result = assert_model_told(run, claims)
    assert "deep" in result["content"]  # the reason says what is wrong
    assert not broken, "\n".join(broken)


def test_tool_returning_5000_deep_list(fuzz: Fuzz) -> None:
    call = ("build", {"kind": "deep_list", "size": 5000})
    run, claims, broken = fuzz.play("fuzzer", [[call]], "ok")
    assert_model_told(run, claims)
    assert not broken, "\n".join(broken)


def test_lone_surrogate_in_irreversible_input(fuzz: Fuzz) -> None:
    value = {"target": "a\ud800b", "nul": "x\x00y", "nested": ["\udfff"]}
    run, _, broken = fuzz.play("fuzzer", [[("launch", {"value": value})]], "ok")
    assert run.status == "waiting", (run.status, run.error[:500])
    intent = ToolIntent.objects.get(run_id=run.pk)
    assert (intent.status, intent.tool) == ("pending", "launch")
    assert intent.input == {"value": value}  # exactly, lone surrogate and NUL included
    assert not broken, "\n".join(broken)


@pytest.mark.parametrize("how", ["sys.exit", "SystemExit", "KeyboardInterrupt", "FuzzAbort"])
def test_tool_raising_base_exception(fuzz: Fuzz, how: str) -> None:
    run, claims, broken = fuzz.play("fuzzer", [[("fail", {"exc": how, "message": "bye"})]], "ok")
    result = assert_model_told(run, claims)
    assert "bye" in result["content"] or how in result["content"]
    assert not broken, "\n".join(broken)


def test_tool_calling_sys_exit_leaves_the_worker_usable(fuzz: Fuzz) -> None:
    # After a tool called sys.exit(), the next run is claimed and finished as usual.
    fuzz.play("fuzzer", [[("fail", {"exc": "sys.exit", "message": "bye"})]], "ok")
    run, claims, broken = fuzz.play("fuzzer", [[("echo", {"value": "after"})]], "ok")
    assert run.status == "succeeded", (run.status, claims, run.error[:500])
    assert tool_results(run)[0]["content"] == "after"
    assert not broken, "\n".join(broken)
