"""Agent schedules: declaring them (``schedule()``), their slots (cron in a time zone, every),
and firing them (``fire_due``): one run per slot, catch-up after an outage, broken schedules,
two firers at once, the fake clock, and what an idle look costs."""

from __future__ import annotations

import datetime as dt
import itertools
import threading
from typing import Any

import pytest
from django.db import connection, connections
from django.test.utils import CaptureQueriesContext

from durable_agents.models import AgentRun, AgentSchedule
from durable_agents.schedules.defining import MAX_CATCH_UP, due_slots, next_slot, schedule, slot_key
from durable_agents.schedules.firing import BATCH, MAX_START_FAILURES, fire_due
from durable_agents.testing import plan
from tests.integration.conftest import call_at_once

pytestmark = pytest.mark.django_db

UTC = dt.UTC
MINUTE = dt.timedelta(minutes=1)


def at(
    year: int, month: int, day: int, hour: int = 0, minute: int = 0, second: int = 0
) -> dt.datetime:
    return dt.datetime(year, month, day, hour, minute, second, tzinfo=UTC)


def runs_of(name: str) -> list[AgentRun]:
    return list(AgentRun.objects.filter(start_key__startswith=f"{name}@").order_by("start_key"))


def set_next_slot(name: str, slot: dt.datetime) -> AgentSchedule:
    AgentSchedule.objects.filter(name=name).update(next_slot=slot)
    return AgentSchedule.objects.get(name=name)


# -- declaring ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"cron": "61 * * * *"}, "not a cron expression"),
        ({"cron": "every day"}, "has 2 fields; a cron expression has five"),
        ({"cron": "0 6 * * *", "timezone": "Europe/Atlantis"}, "no such time zone"),
        ({"cron": "0 6 * * *", "timezone": ""}, "not a time zone name"),
        ({"every": dt.timedelta(0)}, "every= is between"),
        ({"every": dt.timedelta(seconds=-5)}, "every= is between"),
        ({"every": 60}, "every= is a datetime.timedelta"),
        ({"cron": "0 6 * * *", "every": MINUTE}, "not both"),
        ({}, "needs cron= or every="),
    ],
)
def test_bad_timing_is_refused_and_saves_nothing(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        schedule("report", "tester", "Summarise.", **options)
    assert not AgentSchedule.objects.exists()


@pytest.mark.parametrize(
    ("name", "agent", "task", "message"),
    [
        ("report", "nobody", "Summarise.", "no agent named 'nobody'"),
        ("x" * 10_000, "tester", "Summarise.", "at most 150 characters"),
        ("a\x00b", "tester", "Summarise.", "NUL"),
        ("", "tester", "Summarise.", "non-empty"),
        ("report", "tester", "", "non-empty task"),
        ("report", "tester", "a\x00b", "NUL"),
    ],
)
def test_bad_names_agents_and_tasks_are_refused(
    name: str, agent: str, task: str, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        schedule(name, agent, task, every=MINUTE)
    assert not AgentSchedule.objects.exists()


def test_schedule_is_an_upsert_by_name() -> None:
    first = schedule("report", "tester", "Summarise.", cron="0 6 * * *", timezone="Europe/Berlin")
    again = schedule(
        "report",
        "tester",
        "Summarise again.",
        cron="0 6 * * *",
        timezone="Europe/Berlin",
        priority=5,
    )
    assert again.pk == first.pk
    assert AgentSchedule.objects.count() == 1
    row = AgentSchedule.objects.get()
    assert (row.task, row.priority) == ("Summarise again.", 5)
    # Same timing: the next slot stays where it was.
    assert row.next_slot == first.next_slot
    retimed = schedule("report", "tester", "Summarise again.", every=dt.timedelta(hours=1))
    assert (retimed.cron, retimed.every) == ("", dt.timedelta(hours=1))
    assert retimed.next_slot is not None
    assert retimed.next_slot.minute == 0


def test_cron_slots_follow_berlin_across_daylight_saving() -> None:
    row = AgentSchedule(name="night", cron="30 2 * * *", timezone="Europe/Berlin")
    # Spring forward (29 March 2026): 02:30 does not exist; it fires once, at 03:00 CEST.
    spring = [at(2026, 3, 27, 12)]
    for _ in range(3):
        following = next_slot(row, spring[-1])
        assert following is not None
        spring.append(following)
    assert spring[1:] == [at(2026, 3, 28, 1, 30), at(2026, 3, 29, 1), at(2026, 3, 30, 0, 30)]
    # Fall back (25 October 2026): 02:30 comes twice; it fires once, the first time (CEST).
    fall = [at(2026, 10, 23, 12)]
    for _ in range(3):
        following = next_slot(row, fall[-1])
        assert following is not None
        fall.append(following)
    assert fall[1:] == [at(2026, 10, 24, 0, 30), at(2026, 10, 25, 0, 30), at(2026, 10, 26, 1, 30)]
    # An hourly cron on the fall-back night: one slot per real hour, none twice.
    hourly = AgentSchedule(name="hourly", cron="0 * * * *", timezone="Europe/Berlin")
    slots = [at(2026, 10, 24, 22, 30)]
    for _ in range(5):
        following = next_slot(hourly, slots[-1])
        assert following is not None
        slots.append(following)
    assert len(set(slots)) == len(slots)
    assert slots[1:] == [at(2026, 10, 24, 23) + dt.timedelta(hours=h) for h in range(5)]


def test_every_slots_are_aligned_on_the_epoch() -> None:
    row = AgentSchedule(name="often", every=dt.timedelta(minutes=5))
    assert next_slot(row, at(2026, 1, 1, 10, 7, 31)) == at(2026, 1, 1, 10, 10)
    assert next_slot(row, at(2026, 1, 1, 10, 10)) == at(2026, 1, 1, 10, 15)  # strictly after
    odd = AgentSchedule(name="odd", every=dt.timedelta(seconds=7))
    slot = next_slot(odd, at(2026, 1, 1))
    assert slot is not None
    assert (slot - at(1970, 1, 1)).total_seconds() % 7 == 0
    assert dt.timedelta(0) < slot - at(2026, 1, 1) <= dt.timedelta(seconds=7)
    # Saved again with the same interval: the slots do not move.
    first = schedule("often", "tester", "Look.", every=dt.timedelta(minutes=5))
    again = schedule("often", "tester", "Look again.", every=dt.timedelta(minutes=5))
    assert again.next_slot == first.next_slot
    assert first.next_slot is not None
    assert first.next_slot.minute % 5 == 0


def test_due_slots_of_a_cron_schedule_after_an_outage() -> None:
    row = AgentSchedule(name="q", cron="*/15 * * * *", timezone="UTC", next_slot=at(2026, 1, 1))
    now = at(2026, 1, 1, 1, 5)
    assert due_slots(row, now) == [at(2026, 1, 1, 1)]
    row.catch_up = True
    assert due_slots(row, now) == [at(2026, 1, 1, 0, 15 * q) for q in range(4)] + [
        at(2026, 1, 1, 1)
    ]
    # A minutely schedule after a 30-day outage: bounded, oldest first.
    row.cron = "* * * * *"
    slots = due_slots(row, at(2026, 1, 31))
    assert len(slots) == MAX_CATCH_UP
    assert slots[0] == at(2026, 1, 1)
    row.catch_up = False
    assert due_slots(row, at(2026, 1, 31, 0, 0, 30)) == [at(2026, 1, 31)]
    assert due_slots(row, at(2025, 12, 31)) == []


# -- firing ---------------------------------------------------------------------------------


def test_each_slot_starts_one_run_and_moves_the_schedule_on() -> None:
    schedule("tick", "tester", "Count.", every=MINUTE, priority=7, concurrency_key="tenant:a")
    row = AgentSchedule.objects.get()
    slot = row.next_slot
    assert slot is not None
    assert fire_due(slot - dt.timedelta(seconds=1)).runs == []
    fired = fire_due(slot)
    (run,) = fired.runs
    assert run.start_key == slot_key("tick", slot)
    assert (run.agent, run.task, run.priority, run.concurrency_key) == (
        "tester",
        "Count.",
        7,
        "tenant:a",
    )
    row.refresh_from_db()
    assert (row.last_slot, row.last_run_id, row.next_slot) == (slot, run.pk, slot + MINUTE)
    assert fire_due(slot + dt.timedelta(seconds=30)).runs == []  # nothing twice
    # A firer that took the slot again (its move was lost) starts no second run.
    set_next_slot("tick", slot)
    assert [r.pk for r in fire_due(slot).runs] == [run.pk]
    assert len(runs_of("tick")) == 1


@pytest.mark.parametrize("catch_up", [False, True])
def test_after_an_outage_only_the_newest_slot_unless_catch_up(catch_up: bool) -> None:
    schedule("hourly", "tester", "Report.", cron="0 * * * *", catch_up=catch_up)
    start = at(2026, 1, 1)
    set_next_slot("hourly", start)
    # The workers were down from midnight to 05:30.
    fired = fire_due(at(2026, 1, 1, 5, 30))
    expected = (
        [start + dt.timedelta(hours=h) for h in range(6)] if catch_up else [at(2026, 1, 1, 5)]
    )
    assert [r.start_key for r in fired.runs] == [slot_key("hourly", s) for s in expected]
    row = AgentSchedule.objects.get()
    assert (row.last_slot, row.next_slot) == (expected[-1], at(2026, 1, 1, 6))
    assert row.last_run_id == fired.runs[-1].pk


def test_catch_up_is_bounded_per_firing_and_goes_on_at_the_next() -> None:
    schedule("minutely", "tester", "Tick.", every=MINUTE, catch_up=True)
    set_next_slot("minutely", at(2026, 1, 1))
    now = at(2026, 1, 1, 2, 29)  # 150 slots missed
    fired = fire_due(now)
    assert len(fired.runs) == MAX_CATCH_UP
    assert fired.next_in == 0.0  # more are due: the firer looks again at once
    assert AgentSchedule.objects.get().next_slot == at(2026, 1, 1) + MAX_CATCH_UP * MINUTE
    assert len(fire_due(now).runs) == 150 - MAX_CATCH_UP
    assert [r.start_key for r in runs_of("minutely")] == sorted(
        slot_key("minutely", at(2026, 1, 1) + m * MINUTE) for m in range(150)
    )
    assert AgentSchedule.objects.get().next_slot == at(2026, 1, 1, 2, 30)


def test_a_schedule_whose_agent_is_gone_is_broken_and_fires_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    schedule("gone", "tester", "Work.", every=MINUTE)
    schedule("fine", "tester", "Work.", every=MINUTE)
    # Declared before this worker started, by a deploy that had the agent.
    AgentSchedule.objects.filter(name="gone").update(
        agent="removed_by_a_deploy", updated_at=at(2026, 1, 1)
    )
    AgentSchedule.objects.update(next_slot=at(2026, 1, 1))
    fired = fire_due(at(2026, 1, 1, 0, 0, 30))
    assert fired.broken == ["gone"]
    assert [r.start_key for r in fired.runs] == [slot_key("fine", at(2026, 1, 1))]
    gone = AgentSchedule.objects.get(name="gone")
    assert "no agent named 'removed_by_a_deploy'" in gone.broken
    assert gone.last_run_id is None
    assert caplog.text.count("'gone' fires nothing") == 1
    # Broken rows are out of the firing: later looks neither fire nor log them again.
    AgentSchedule.objects.filter(name="fine").update(next_slot=at(2026, 1, 1, 0, 1))
    assert fire_due(at(2026, 1, 1, 0, 1)).broken == []
    assert caplog.text.count("'gone' fires nothing") == 1
    # Declared again (the agent is back, or fixed): sound again, from its next slot on, without
    # catching up on the slots it did not fire while broken.
    fixed = schedule("gone", "tester", "Work.", every=MINUTE, catch_up=True)
    assert fixed.broken == ""
    assert fixed.next_slot is not None
    assert fixed.next_slot > at(2026, 1, 2)


def test_a_schedule_declared_after_the_worker_started_for_an_agent_it_lacks_is_left_to_others(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A rolling deploy: the new code declares a schedule of a new agent while workers of the
    old deploy still run. They leave it (due, sound) for a worker that knows the agent."""
    schedule("new-agent", "tester", "Work.", every=MINUTE)
    AgentSchedule.objects.update(agent="only_in_the_next_deploy", next_slot=at(2026, 1, 1))
    fired = fire_due(at(2026, 1, 1, 0, 0, 30))
    assert (fired.broken, fired.runs, fired.left) == ([], [], ["new-agent"])
    assert fired.next_in is None  # not looked at again at once
    row = AgentSchedule.objects.get()
    assert (row.broken, row.next_slot, row.last_slot) == ("", at(2026, 1, 1), None)
    assert "fires nothing" not in caplog.text
    # A worker of the new deploy (it knows the agent) fires it.
    AgentSchedule.objects.update(agent="tester")
    assert [r.start_key for r in fire_due(at(2026, 1, 1, 0, 0, 30)).runs] == [
        slot_key("new-agent", at(2026, 1, 1))
    ]


def test_a_cron_expression_that_no_longer_parses_breaks_only_its_schedule() -> None:
    schedule("bad", "tester", "Work.", cron="0 * * * *")
    schedule("good", "tester", "Work.", cron="0 * * * *")
    AgentSchedule.objects.filter(name="bad").update(cron="0 25 * * *")
    AgentSchedule.objects.update(next_slot=at(2026, 1, 1))
    fired = fire_due(at(2026, 1, 1, 0, 10))
    assert fired.broken == ["bad"]
    assert [r.start_key for r in fired.runs] == [slot_key("good", at(2026, 1, 1))]
    assert "no longer parses" in AgentSchedule.objects.get(name="bad").broken


def test_a_paused_schedule_fires_nothing_and_resumes_at_the_next_slot() -> None:
    schedule("paused", "tester", "Work.", every=MINUTE, enabled=False)
    AgentSchedule.objects.update(next_slot=at(2026, 1, 1))
    assert fire_due(at(2026, 1, 2)).runs == []
    resumed = schedule("paused", "tester", "Work.", every=MINUTE)
    assert resumed.next_slot is not None
    assert resumed.next_slot > at(2026, 1, 2)


def _statements(queries: CaptureQueriesContext) -> list[str]:
    """The statements sent, without the transaction's own (BEGIN, COMMIT, savepoints)."""
    return [
        q["sql"]
        for q in queries.captured_queries
        if not q["sql"].startswith(("BEGIN", "COMMIT", "SAVEPOINT", "RELEASE SAVEPOINT"))
    ]


def test_the_idle_look_is_one_statement() -> None:
    for i in range(5):
        schedule(f"s{i}", "tester", "Work.", every=dt.timedelta(hours=1))
    with CaptureQueriesContext(connection) as queries:
        fired = fire_due()
    [sql] = _statements(queries)
    assert fired.runs == []
    assert fired.next_in is not None
    assert 0 < fired.next_in <= 3600
    assert "LIMIT 1" in sql


def test_a_due_batch_costs_a_constant_number_of_statements() -> None:
    """A batch costs the same statements however many schedules are due: on PostgreSQL the
    look that takes them and the one statement that fires them (runs, task steps, moves);
    elsewhere the look, the locking SELECT and one UPDATE for the schedule rows, three for
    their runs."""
    counts = {}
    for size in (3, 30):
        AgentSchedule.objects.all().delete()
        for i in range(size):
            schedule(f"b{size}-{i}", "tester", "Work.", every=MINUTE)
        AgentSchedule.objects.update(next_slot=at(2026, 1, 1))
        with CaptureQueriesContext(connection) as queries:
            fired = fire_due(at(2026, 1, 1, 0, 0, 1))
        assert len(fired.run_ids) == size
        statements = _statements(queries)
        on_schedules = [sql for sql in statements if "agent_schedule" in sql]
        counts[size] = (len(on_schedules), len(statements))
    if connection.vendor == "postgresql":
        assert counts == {3: (2, 2), 30: (2, 2)}
    else:  # SQLite splits INSERTs by its parameter limit
        assert {on for on, _ in counts.values()} == {3}
    assert BATCH >= 30


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_the_due_look_reads_the_partial_index() -> None:
    for i in range(200):
        schedule(f"i{i}", "tester", "Work.", every=dt.timedelta(hours=1))
    with CaptureQueriesContext(connection) as queries:
        fire_due()
    [sql] = _statements(queries)
    with connection.cursor() as cursor:
        cursor.execute("SET enable_seqscan = off")
        cursor.execute("EXPLAIN " + sql)
        plan = "\n".join(row[0] for row in cursor.fetchall())
        cursor.execute("RESET enable_seqscan")
    # The earliest slot and the due schedules, both from the partial index.
    assert plan.count("agent_schedule_due") == 2, plan


# -- two firers at once (PostgreSQL) --------------------------------------------------------


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_two_threads_firing_at_once_start_one_run_per_slot(unpooled: None) -> None:
    names = [f"race{i}" for i in range(40)]
    for name in names:
        schedule(name, "tester", "Race.", every=MINUTE, catch_up=True)
    start = at(2026, 1, 1)
    for rounds in range(5):
        AgentSchedule.objects.update(next_slot=start + rounds * 3 * MINUTE)
        now = start + rounds * 3 * MINUTE + 2 * MINUTE  # three slots due per schedule

        def fire(_: int, now: dt.datetime = now) -> list[str]:
            return [r.start_key or "" for r in fire_due(now, batch=7).runs]

        started, errors = call_at_once(fire, 4, join_seconds=120)  # four firers at once
        assert errors == []
        keys = [key for batch in started for key in batch]
        # No firer started (or even returned) a slot another one fired.
        assert len(keys) == len(set(keys)) == 3 * len(names)
    assert AgentRun.objects.count() == 5 * 3 * len(names)
    for name in names:
        slots = [run.start_key for run in runs_of(name)]
        assert slots == sorted({slot_key(name, start + m * MINUTE) for m in range(15)})


# -- the fake clock -------------------------------------------------------------------------


def test_the_fake_clock_fires_the_slots_it_passes(agent_runner: Any, durable_clock: Any) -> None:
    schedule("every5", "tester", plan(task="Check."), every=5 * MINUTE)
    schedule("every5-all", "tester", plan(task="Check all."), every=5 * MINUTE, catch_up=True)
    first = AgentSchedule.objects.get(name="every5-all").next_slot
    assert first is not None
    durable_clock.advance(hours=1)
    newest = [r for r in durable_clock.fired if (r.start_key or "").startswith("every5@")]
    caught_up = [r.start_key for r in durable_clock.fired if r not in newest]
    # Twelve slots in an hour (thirteen if one falls in the milliseconds the test took).
    assert len(caught_up) in (12, 13)
    assert caught_up == [
        slot_key("every5-all", first + 5 * MINUTE * i) for i in range(len(caught_up))
    ]
    # Without catch_up, only the newest of the slots the hour passed.
    assert [r.start_key for r in newest] == [
        slot_key("every5", first + 5 * MINUTE * (len(caught_up) - 1))
    ]
    result = agent_runner.drive(newest[0])
    assert result.status == "succeeded"
    before = len(durable_clock.fired)
    durable_clock.advance(minutes=5)
    assert len(durable_clock.fired) == before + 2
    with pytest.raises(ValueError, match="only goes forward"):
        durable_clock.advance(hours=-1)
    durable_clock.advance(30)  # seconds, positionally, as before
    assert durable_clock.offset == 3600 + 300 + 30


@pytest.mark.postgres
def test_a_run_the_database_refuses_leaves_its_schedule_due_and_the_others_fire() -> None:
    """The batch's runs start together; when the database refuses one (here a trigger), they
    start one by one: the refused one's schedule stays due, the others move on."""
    with connection.cursor() as cursor:
        cursor.execute(
            "CREATE FUNCTION refuse_explode() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN"
            " IF NEW.task = 'Explode.' THEN RAISE EXCEPTION 'refused'; END IF;"
            " RETURN NEW; END $$"
        )
        cursor.execute(
            "CREATE TRIGGER refuse_explode BEFORE INSERT ON agent_run"
            " FOR EACH ROW EXECUTE FUNCTION refuse_explode()"
        )
    schedule("explodes", "tester", "Explode.", every=MINUTE)
    schedule("fine", "tester", "Work.", every=MINUTE)
    AgentSchedule.objects.update(next_slot=at(2026, 1, 1))
    fired = fire_due(at(2026, 1, 1, 0, 0, 30))
    assert [r.start_key for r in fired.runs] == [slot_key("fine", at(2026, 1, 1))]
    assert fired.broken == []
    explodes = AgentSchedule.objects.get(name="explodes")
    assert (explodes.next_slot, explodes.last_slot, explodes.broken) == (at(2026, 1, 1), None, "")
    assert AgentSchedule.objects.get(name="fine").next_slot == at(2026, 1, 1, 0, 1)
    # Tried again at the next tick, not at once (no busy loop on a refusal)...
    assert fired.next_in == 30.0
    # ...and broken once the database refused it MAX_START_FAILURES times in a row.
    for _ in range(MAX_START_FAILURES - 2):
        assert fire_due(at(2026, 1, 1, 0, 0, 30)).broken == []
    assert fire_due(at(2026, 1, 1, 0, 0, 30)).broken == ["explodes"]
    assert "refused its run" in AgentSchedule.objects.get(name="explodes").broken


@pytest.mark.parametrize("concurrency_key", [None, "tenant:a"])
def test_a_fired_run_is_stored_as_start_run_stores_it(concurrency_key: str | None) -> None:
    """The batch insert of a firing writes every column ``start_run`` writes, the same way."""
    from durable_agents.api import start_run
    from durable_agents.models import AgentStep

    schedule(
        "same", "tester", "Compare me.", every=MINUTE, priority=3, concurrency_key=concurrency_key
    )
    set_next_slot("same", at(2026, 1, 1))
    (fired,) = fire_due(at(2026, 1, 1, 0, 0, 1)).runs
    by_hand = start_run(
        "tester", "Compare me.", key="by-hand", priority=3, concurrency_key=concurrency_key
    )
    skip = {"id", "start_key", "created_at", "updated_at", "fair_at"}
    columns = [f.attname for f in AgentRun._meta.concrete_fields if f.attname not in skip]
    fired_row = AgentRun.objects.filter(pk=fired.pk).values(*columns).get()
    assert fired_row == AgentRun.objects.filter(pk=by_hand.pk).values(*columns).get()
    steps = [
        list(AgentStep.objects.filter(run_id=pk).values_list("seq", "kind", "payload", "attempt"))
        for pk in (fired.pk, by_hand.pk)
    ]
    assert steps[0] == steps[1] == [(0, "task", '"Compare me."', 0)]


def test_a_fired_runs_task_is_encrypted_at_rest(da_settings: Any) -> None:
    """The batch insert seals the task step as the ORM does (``ENCRYPTION_KEYS``)."""
    import base64

    from durable_agents._internal import encryption

    da_settings(ENCRYPTION_KEYS=[base64.urlsafe_b64encode(b"A" * 32).decode()])
    schedule("secret", "tester", "Keep me secret.", every=MINUTE)
    set_next_slot("secret", at(2026, 1, 1))
    (run,) = fire_due(at(2026, 1, 1, 0, 0, 1)).runs
    run_id = run.pk.hex if connection.vendor == "sqlite" else str(run.pk)
    with connection.cursor() as cursor:
        cursor.execute("SELECT payload FROM agent_step WHERE run_id = %s", [run_id])
        (raw,) = cursor.fetchone()
    assert raw.startswith(f"da:enc:v1:{encryption.key_id(b'A' * 32)}:")
    assert "secret" not in raw
    assert run.steps.get().payload == '"Keep me secret."'


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_slot_whose_key_a_start_run_takes_meanwhile_points_at_that_run(unpooled: None) -> None:
    """A ``start_run`` with a slot's key commits while the firing's statement waits on it:
    the slot starts no run of its own, and the schedule's last run is the one that won."""
    from django.db import transaction

    from durable_agents.api import start_run

    schedule("contested", "tester", "Scheduled.", every=MINUTE)
    slot = at(2026, 1, 1)
    set_next_slot("contested", slot)
    key = slot_key("contested", slot)
    holding = threading.Event()
    firer_pid: list[int] = []
    won: list[Any] = []
    errors: list[BaseException] = []

    def other_caller() -> None:
        try:
            with transaction.atomic():
                won.append(start_run("tester", "By hand.", key=key))
                holding.set()
                # Commit only once the firing waits for this insert to end.
                with connection.cursor() as cursor:
                    for _ in range(600):
                        cursor.execute(
                            "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s",
                            firer_pid,
                        )
                        if cursor.fetchone() == ("Lock",):
                            break
                        threading.Event().wait(0.05)
                    else:
                        raise AssertionError("the firing never waited on the insert")
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
            holding.set()
        finally:
            connections.close_all()

    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        firer_pid.append(cursor.fetchone()[0])
    thread = threading.Thread(target=other_caller)
    thread.start()
    assert holding.wait(30)
    fired = fire_due(slot)
    thread.join(60)
    assert errors == []
    [run] = won
    assert fired.run_ids == [run.pk]
    assert [r.task for r in runs_of("contested")] == ["By hand."]
    row = AgentSchedule.objects.get(name="contested")
    assert (row.last_slot, row.last_run_id, row.next_slot) == (slot, run.pk, slot + MINUTE)


def test_a_batch_of_one_keys_slots_takes_the_keys_turns_one_after_the_other() -> None:
    """Runs of one concurrency key fired together get successive turns (``fair_at``), as
    ``start_run`` gives them one call at a time, and the key's next turn moves past them."""
    from durable_agents.api import start_run
    from durable_agents.models import ConcurrencyKey
    from durable_agents.store.concurrency import FAIR_SPACING

    for i in range(3):
        schedule(f"keyed{i}", "tester", f"Keyed {i}.", every=MINUTE, concurrency_key="tenant:t")
    schedule("unkeyed", "tester", "Free.", every=MINUTE)
    AgentSchedule.objects.update(next_slot=at(2026, 1, 1))
    fired = fire_due(at(2026, 1, 1, 0, 0, 1))
    keyed = sorted(r.fair_at for r in fired.runs if r.concurrency_key == "tenant:t")
    assert len(keyed) == 3
    assert [b - a for a, b in itertools.pairwise(keyed)] == [FAIR_SPACING] * 2
    key_row = ConcurrencyKey.objects.get(key="tenant:t")
    assert key_row.next_fair_at == keyed[-1] + FAIR_SPACING
    # The next run of the key, started by hand, queues behind them.
    assert start_run("tester", "After.", concurrency_key="tenant:t").fair_at == (
        keyed[-1] + FAIR_SPACING
    )
    [free] = [r for r in fired.runs if r.concurrency_key is None]
    assert free.fair_at is not None


def test_one_batch_fires_the_slots_of_several_agents_each_with_its_own_version() -> None:
    from durable_agents.declare.agents import registry

    agents = ["tester", "thinker", "short", "tester"]
    for i, agent in enumerate(agents):
        schedule(f"mixed{i}", agent, f"Task {i}.", every=MINUTE, priority=i)
    AgentSchedule.objects.update(next_slot=at(2026, 1, 1))
    fired = fire_due(at(2026, 1, 1, 0, 0, 1))
    by_task = {run.task: run for run in fired.runs}
    for i, agent in enumerate(agents):
        run = by_task[f"Task {i}."]
        definition = registry.get(agent, None)
        assert (run.agent, run.prompt_version, run.model, run.priority) == (
            agent,
            definition.version,
            definition.model,
            i,
        )
        assert run.fingerprint == definition.fingerprint(definition.model)
        assert run.start_key == slot_key(f"mixed{i}", at(2026, 1, 1))
