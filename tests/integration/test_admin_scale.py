"""The admin at production size: the stored cause of a dead run, bounded counts and
pages, skip-scan filters, indexed search, the dead letter by cause and the operations page's
windows. Speed itself is measured by bench/admin_scale.py; these tests pin the behaviour and,
on PostgreSQL, that each query has the shape its index answers."""

from __future__ import annotations

import datetime
import re
from typing import Any
from urllib.parse import urlencode

import pytest
from django.db import IntegrityError, connection
from django.db.models import Count
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone

import durable_agents
from durable_agents import store
from durable_agents._internal import counting
from durable_agents.admin import AgentRunAdmin, listing
from durable_agents.admin import dead_letter as views
from durable_agents.causes import backfill_causes, cause_of
from durable_agents.housekeeping import sweeps as housekeeping
from durable_agents.models import (
    AgentRun,
    AgentStep,
    IntentStatus,
    RunStatus,
    StepKind,
    ToolIntent,
    new_run_id,
    short_id,
)
from durable_agents.models.runs import short_id_match, time_ordered_id_ending
from tests.integration.test_admin import messages_of, parked_intent, runs_url

pytestmark = pytest.mark.django_db
postgres_only = pytest.mark.skipif(
    "connection.vendor != 'postgresql'", reason="PostgreSQL's indexes and planner"
)


def dead(task: str, reason: str) -> AgentRun:
    run = durable_agents.start_run("tester", task)
    assert store.current().dead_letter(run.pk, reason)
    return AgentRun.objects.get(pk=run.pk)


def listed(client: Client, query: str = "") -> list[Any]:
    response = client.get(runs_url(query))
    assert response.status_code == 200, response
    return [run.pk for run in response.context["cl"].result_list]


# -- the stored cause ---------------------------------------------------------------------


def test_the_store_writes_the_cause_when_a_run_is_dead_lettered_and_clears_it_after() -> None:
    first = dead("a", "overloaded_error (request id req_011CXa) after 3 tries\nTraceback ...")
    second = dead("b", "overloaded_error (request id req_9) after 12 tries")
    assert (
        first.dead_cause
        == second.dead_cause
        == "overloaded_error (request id <id>) after <n> tries"
    )
    assert store.current().requeue_run(first.pk)
    assert AgentRun.objects.get(pk=first.pk).dead_cause == ""
    durable_agents.cancel_run(second.pk)
    assert AgentRun.objects.get(pk=second.pk).dead_cause == ""
    # A cause is cut to fit its indexed column.
    assert len(cause_of("x" * 5000)) == 255


def test_backfill_gives_runs_dead_before_the_column_their_cause() -> None:
    runs = [dead(f"t{i}", f"tool lookup failed on row {i}") for i in range(5)]
    AgentRun.objects.filter(pk__in=[r.pk for r in runs]).update(dead_cause="")
    durable_agents.start_run("tester", "alive")  # not dead: left alone
    assert backfill_causes(AgentRun, batch_size=2) == 5
    causes = set(AgentRun.objects.dead().values_list("dead_cause", flat=True))
    assert causes == {"tool lookup failed on row <n>"}
    assert AgentRun.objects.exclude(status=RunStatus.DEAD).filter(dead_cause="").count() == 1


# -- counting and paging ------------------------------------------------------------------


@pytest.fixture
def small_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(counting, "EXACT_COUNT_LIMIT", 5)
    monkeypatch.setattr(AgentRunAdmin, "list_per_page", 2)


def test_counts_are_exact_up_to_the_limit_then_an_estimate_that_says_so(
    admin_client: Client, small_limits: None
) -> None:
    for i in range(4):
        durable_agents.start_run("tester", f"task {i}")
    page = admin_client.get(runs_url()).content.decode()
    assert '<span id="result-count">4 agent runs</span>' in page
    for i in range(4):
        durable_agents.start_run("tester", f"more {i}")
    response = admin_client.get(runs_url())
    counted = response.context["cl"].paginator
    # PostgreSQL's planner estimates (never below what was counted); SQLite has no estimate.
    assert counted.count_is_estimate
    assert counted.count >= 5
    text = response.context["cl"].result_count_text
    expected = "about" if connection.vendor == "postgresql" else "more than 5"
    assert text.startswith(expected), text
    # The pages stop where the exact count does (5 rows: pages 1 to 2 of 2 rows each).
    assert counted.num_pages == 2
    assert counted.pages_end_early
    assert "filter or search to go further" in response.content.decode()
    assert len(listed(admin_client, "?p=2")) == 2
    assert admin_client.get(runs_url("?p=3")).status_code == 302  # ?e=1, Django's answer


def test_dead_count_in_the_list_is_bounded(admin_client: Client, small_limits: None) -> None:
    for i in range(7):
        dead(f"t{i}", "gone")
    count = admin_client.get(runs_url()).context["dead_count"]
    assert not count.exact
    assert count.value >= 5
    assert str(count).startswith("about" if connection.vendor == "postgresql" else "more than 5")


# -- filters ------------------------------------------------------------------------------


def test_agent_and_model_filters_list_their_values_by_skip_scan(admin_client: Client) -> None:
    for model in ("model-c", "model-a", "model-b", "model-a"):
        run = durable_agents.start_run("tester", "t")
        AgentRun.objects.filter(pk=run.pk).update(model=model)
    values = listing.distinct_values(AgentRun.objects.all(), "model")
    assert values == ["model-a", "model-b", "model-c"]
    assert listing.distinct_values(AgentRun.objects.all(), "model", limit=2) == values[:2]
    page = admin_client.get(runs_url()).content.decode()
    for model in values:
        assert f"?model={model}" in page
    assert len(listed(admin_client, "?model=model-a")) == 2
    # No date hierarchy (it reads the date of every row); "created" is a range filter.
    assert 'class="toplinks"' not in page
    assert "created_at__gte" in page


def test_the_priority_filter_lists_the_priorities_in_use(admin_client: Client) -> None:
    urgent = durable_agents.start_run("tester", "urgent", priority=90)
    for priority in (0, 20, 20):
        durable_agents.start_run("tester", "t", priority=priority)
    values: list[Any] = listing.distinct_values(AgentRun.objects.all(), "priority")
    assert values == [0, 20, 90]  # ints: the column's own values
    page = admin_client.get(runs_url()).content.decode()
    for priority in (0, 20, 90):
        assert f"?priority={priority}" in page
    assert listed(admin_client, "?priority=90") == [urgent.pk]
    assert len(listed(admin_client, "?priority=20")) == 2


# -- search -------------------------------------------------------------------------------


def test_words_are_found_in_the_recent_window_and_through_the_index_before_it(
    admin_client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(listing, "RECENT_WINDOW", 3)
    old = durable_agents.start_run("tester", 'Refund order 4242 "quoted" for ACME')
    AgentRun.objects.filter(pk=old.pk).update(
        created_at=timezone.now() - datetime.timedelta(days=30)
    )
    for i in range(5):
        durable_agents.start_run("tester", f"Refund order {i}")
    assert listed(admin_client, "?q=order+4242") == [old.pk]  # older than the window
    assert listed(admin_client, '?q="quoted"+acme') == [old.pk]  # JSON-escaped in the step
    assert len(listed(admin_client, "?q=refund+ORDER")) == 6
    assert listed(admin_client, "?q=4242+acme") == [old.pk]
    # A number is a whole word (an order number must not find 14242); other words are parts.
    other = durable_agents.start_run("tester", "Refund order 14242, then INV-4242b")
    assert listed(admin_client, "?q=order+4242") == [old.pk]
    assert listed(admin_client, "?q=14242") == [other.pk]
    assert listed(admin_client, "?q=inv-4242b") == [other.pk]
    assert set(listed(admin_client, "?q=efun")) == set(listed(admin_client, "?q=refund"))
    # LIKE's wildcards are searched for, not obeyed.
    assert listed(admin_client, "?q=100%25") == []
    assert listed(admin_client, "?q=ord_r") == []
    # A word a trigram index cannot look up is left out, and the page says so.
    response = admin_client.get(runs_url("?q=4242+of"))
    assert [r.pk for r in response.context["cl"].result_list] == [old.pk]
    assert any("too short" in m for m in messages_of(response))


def test_a_search_with_more_matches_than_it_lists_says_so(
    admin_client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(listing, "MAX_SEARCH_MATCHES", 2)
    runs = [durable_agents.start_run("tester", f"invoice {i}") for i in range(4)]
    response = admin_client.get(runs_url("?q=invoice"))
    assert [r.pk for r in response.context["cl"].result_list] == [r.pk for r in runs[:1:-1]]
    assert any("newest 2 matches" in m for m in messages_of(response))


def test_a_request_id_prefix_finds_the_run_that_made_the_request(admin_client: Client) -> None:
    run = durable_agents.start_run("tester", "t")
    durable_agents.start_run("tester", "other")
    AgentStep.objects.create(
        run=run, seq=1, kind=StepKind.MODEL_TURN, payload="{}", request_id="req_011CXabcdef"
    )
    assert listed(admin_client, "?q=req_011CXab") == [run.pk]
    assert listed(admin_client, "?q=req_011CXzz") == []


def test_a_start_key_finds_its_run_exactly_in_the_same_queries(admin_client: Client) -> None:
    keyed = durable_agents.start_run("tester", "Refund the order", key="ticket 7/2024")
    uuid_key = "6f1c2a3b-0d4e-4f5a-8b6c-7d8e9f0a1b2c"
    by_uuid = durable_agents.start_run("tester", "Refund the order", key=uuid_key)
    by_request = durable_agents.start_run("tester", "Refund the order", key="req_client42")
    durable_agents.start_run("thinker", "Refund the order")

    def search(term: str) -> tuple[list[Any], int]:
        with CaptureQueriesContext(connection) as queries:
            found = listed(admin_client, "?" + urlencode({"q": term}))
        return found, len(queries)

    assert search("ticket 7/2024")[0] == [keyed.pk]
    assert search(uuid_key)[0] == [by_uuid.pk]  # a key that looks like a run id
    assert search("req_client42")[0] == [by_request.pk]  # or like a request id
    assert search("ticket 7")[0] == []  # exactly the key: no prefix of it
    # Finding by key is a condition of the list's own query: no query more than a search
    # that names no key.
    assert search("ticket 7/2024")[1] == search("ticket 7/2025")[1]


# -- the dead letter ----------------------------------------------------------------------


def test_the_dead_letter_pages_its_groups_in_a_bounded_number_of_queries(
    admin_client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(views, "DEAD_GROUPS_PER_PAGE", 2)
    url = reverse("admin:durable_agents_agentrun_dead_letter")
    for i in range(3):
        dead(f"a{i}", f"overloaded (request id req_{i})")
    dead("b", "retired model")

    def count_queries(query: str = "") -> tuple[int, Any]:
        with CaptureQueriesContext(connection) as ctx:
            response = admin_client.get(url + query)
        assert response.status_code == 200
        return len(ctx), response

    few, response = count_queries()
    assert [(g.cause, g.count) for g in response.context["groups"]] == [
        ("overloaded (request id <id>)", 3),
        ("retired model", 1),
    ]
    for i in range(3):
        dead(f"c{i}", f"tool {i} raised")
    many, response = count_queries()
    assert many == few <= 15
    assert [g.count for g in response.context["groups"]] == [3, 3]
    assert response.context["page"].has_next
    _, second = count_queries("?page=2")
    assert [g.cause for g in second.context["groups"]] == ["retired model"]
    for hostile in ("?page=99999999999999999999999", "?page=-3", "?page=x"):
        assert admin_client.get(url + hostile).status_code == 200
    # Each group's runs are one click away, through the cause's index.
    group = response.context["groups"][0]
    runs = listed(admin_client, f"?status__exact=dead&{group.runs_query}")
    assert len(runs) == 3


# -- the operations page ------------------------------------------------------------------


def test_the_operations_page_says_the_window_of_each_figure(admin_client: Client) -> None:
    url = reverse("admin:durable_agents_agentrun_operations")
    recent, old = (durable_agents.start_run("tester", t) for t in ("recent", "old"))
    AgentRun.objects.filter(pk=recent.pk).update(
        status=RunStatus.SUCCEEDED, finished_at=timezone.now()
    )
    AgentRun.objects.filter(pk=old.pk).update(
        status=RunStatus.SUCCEEDED, finished_at=timezone.now() - datetime.timedelta(days=2)
    )
    housekeeping.snapshot_metrics()
    with CaptureQueriesContext(connection) as ctx:
        response = admin_client.get(url)
    assert len(ctx) <= 15
    context = response.context
    finished = {bar.label: bar.value for bar in context["finished_bars"]}
    assert finished["succeeded"] == 1  # the run of two days ago is outside the window
    assert context["table"].by_status["succeeded"] == 2  # the snapshot counts the table
    content = response.content.decode()
    assert "Finished in the last 24 hours: 1" in content
    assert "as counted by housekeeping" in content


# -- PostgreSQL: each query has the shape of its index ------------------------------------


def plan(queryset: Any) -> str:
    sql, params = queryset.query.sql_with_params()
    with connection.cursor() as cursor:
        cursor.execute("SET LOCAL enable_seqscan = off")
        cursor.execute("EXPLAIN " + sql, params)
        return "\n".join(row[0] for row in cursor.fetchall())


@postgres_only
@pytest.mark.django_db(transaction=False)
def test_each_admin_query_can_use_its_index() -> None:
    runs = AgentRun.objects.all()
    pg = listing.PostgresDialect()
    # Words of a task: ILIKE on the task step (Django's icontains, UPPER() LIKE, could not).
    step = AgentStep.objects.filter(kind=StepKind.TASK)
    assert "agent_step_task_trgm" in plan(pg.contains_words(step, "payload", ["4242"]))
    reasons = runs.filter(status__in=listing.REASON_STATUSES)
    with connection.cursor() as cursor:  # rolled back with the test: the btree on status
        cursor.execute("DROP INDEX agent_run_status")  # would serve a table this small
    # Unordered: on a table never analysed the planner guesses its rows from the row's width,
    # and with the newest first a backward scan of agent_run_created may win instead; what
    # is asked here is whether the reason's condition can use its index.
    by_reason = pg.contains_words(reasons, "error", ["overloaded"]).order_by()
    assert "agent_run_error_trgm" in plan(by_reason)
    by_prefix = AgentStep.objects.filter(request_id__startswith="req_011")
    assert "agent_step_request_id_prefix" in plan(by_prefix)
    assert "agent_run_created" in plan(runs.order_by("-created_at")[:50])
    assert "agent_run_agent" in plan(runs.filter(agent="x").order_by("-created_at")[:50])
    assert "agent_run_model" in plan(runs.filter(model="x").order_by("-created_at")[:50])
    by_priority = runs.filter(priority=90).order_by("-created_at")[:50]
    assert "agent_run_priority" in plan(by_priority)
    dead = runs.filter(status=RunStatus.DEAD, dead_cause="x").order_by("-created_at")
    assert "agent_run_dead_cause" in plan(dead[:50])
    finished = runs.filter(
        status__in=["succeeded"], finished_at__isnull=False, finished_at__gte=timezone.now()
    )
    assert "agent_run_finished" in plan(finished)
    waiting = runs.filter(status=RunStatus.WAITING).order_by().values_list("waiting_for")
    assert "agent_run_waiting" in plan(waiting.annotate(n=Count("*")))
    # A run by its start key: the store's look-up (agent and key) and the search (key alone).
    assert "agent_run_start_key" in plan(runs.filter(agent="x", start_key="k").order_by()[:1])
    assert "agent_run_start_key" in plan(runs.filter(start_key="k").order_by())
    history = ToolIntent.objects.exclude(status=IntentStatus.PENDING).order_by("-created_at")
    assert "tool_intent_created" in plan(history[:50])
    # A run by its short id: the first digits of a random id (a range of the primary key),
    # the last digits of a time-ordered one (the index on the id's last 8 digits).
    assert "agent_run_id_tail" in plan(runs.filter(time_ordered_id_ending("9c41e07b")))
    by_short_id = plan(runs.filter(short_id_match("9c41e07b")).order_by())
    assert "agent_run_id_tail" in by_short_id
    assert "agent_run_pkey" in by_short_id
    # The planner's estimate is what the list prints past the exact limit.
    assert isinstance(counting.PostgresRowEstimator().estimate_rows(runs), int)


def _runs_of_one_minute(count: int) -> list[AgentRun]:
    """``count`` runs made in the same minute: their ids share their first 8 digits."""
    moment = 1_700_000_000_000
    runs = [
        AgentRun(
            id=new_run_id(now_ms=moment + i),
            agent="tester",
            prompt_version="v1",
            model="m",
            task=f"task {i}",
        )
        for i in range(count)
    ]
    AgentRun.objects.bulk_create(runs)
    return runs


@postgres_only
@pytest.mark.django_db(transaction=False)
def test_the_short_id_page_reads_a_time_ordered_run_through_its_index(
    admin_client: Client,
) -> None:
    """The page that opens a run by its short id (the last digits of a time-ordered id) reads
    the index on those digits, not the table: EXPLAIN of the very statement the page ran, on a
    table the planner knows the size of, with sequential scans allowed."""
    runs = _runs_of_one_minute(5_000)
    target = runs[2_345]
    assert {run.pk.hex[:8] for run in runs} == {target.pk.hex[:8]}  # the head tells none apart
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE agent_run")
    with CaptureQueriesContext(connection) as ctx:
        response = admin_client.get(
            reverse("admin:durable_agents_agentrun_change", args=[short_id(target.pk)])
        )
    assert response.status_code == 302
    assert response["Location"] == reverse("admin:durable_agents_agentrun_change", args=[target.pk])
    [by_tail] = [q["sql"] for q in ctx.captured_queries if "RIGHT(" in q["sql"]]
    with connection.cursor() as cursor:
        cursor.execute("EXPLAIN " + by_tail)
        explained = "\n".join(row[0] for row in cursor.fetchall())
    assert re.search(r"(Index Scan|Bitmap Index Scan) (using|on) agent_run_id_tail", explained), (
        explained
    )
    assert "Seq Scan" not in explained, explained


@pytest.mark.skipif("connection.vendor != 'sqlite'", reason="SQLite's query planner")
def test_sqlite_looks_a_short_id_up_through_its_index_too() -> None:
    """SQLite uses an index on an expression only for the expression written as in the index,
    constants included (``IdTail`` writes them so)."""
    _runs_of_one_minute(50)
    sql, params = AgentRun.objects.filter(
        time_ordered_id_ending("9c41e07b")
    ).query.sql_with_params()
    with connection.cursor() as cursor:
        cursor.execute("EXPLAIN QUERY PLAN " + sql, params)
        explained = " ".join(str(row[-1]) for row in cursor.fetchall())
    assert "USING INDEX agent_run_id_tail" in explained, explained


# -- the intents list ---------------------------------------------------------------------


def test_the_intents_list_pages_a_queue_then_a_history(
    admin_client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Waiting intents oldest first, then decided ones newest first, read from two index
    scans page by page (ToolIntentAdmin.list_per_page 2 here): the same order as one sort."""
    from durable_agents.admin import ToolIntentAdmin

    monkeypatch.setattr(ToolIntentAdmin, "list_per_page", 2)
    now = timezone.now()
    intents = [parked_intent(table=f"t{i}") for i in range(5)]
    for age, intent in enumerate(intents):  # t0 is the newest
        ToolIntent.objects.filter(pk=intent.pk).update(
            created_at=now - datetime.timedelta(minutes=age)
        )
    ToolIntent.objects.filter(pk__in=[intents[0].pk, intents[3].pk]).update(
        status=IntentStatus.DONE
    )
    url = reverse("admin:durable_agents_toolintent_changelist")

    def page(query: str) -> list[Any]:
        response = admin_client.get(url + query)
        assert response.status_code == 200
        return [intent.pk for intent in response.context["cl"].result_list]

    queue = [intents[4].pk, intents[2].pk, intents[1].pk]  # waiting, oldest first
    history = [intents[0].pk, intents[3].pk]  # decided, newest first
    assert page("") + page("?p=2") + page("?p=3") == queue + history
    # A column header's order is Django's own sort.
    assert len(page("?o=-1")) == 2


@postgres_only
@pytest.mark.django_db(transaction=True)
def test_migration_0007_builds_again_an_index_an_interrupted_build_left_invalid() -> None:
    """CREATE INDEX CONCURRENTLY that fails half-way leaves an INVALID index behind: running
    the migration again must drop and build it, and keep a valid one as it is."""
    import importlib

    migration = importlib.import_module("durable_agents.migrations.0007_admin_indexes")
    for _ in range(2):
        durable_agents.start_run("tester", "the same task")
    name = "agent_run_task_probe"
    with connection.cursor() as cursor:
        # A unique index over a duplicated value fails, and stays behind INVALID.
        with pytest.raises(Exception, match="could not create unique index"):
            cursor.execute(f"CREATE UNIQUE INDEX CONCURRENTLY {name} ON agent_run (task)")
        valid = f"SELECT indisvalid FROM pg_index WHERE indexrelid = '{name}'::regclass"
        cursor.execute(valid)
        assert cursor.fetchone() == (False,)
    statement = f"CREATE INDEX CONCURRENTLY {name} ON agent_run (task)"
    try:
        with connection.schema_editor(atomic=False) as editor:
            migration._build_concurrently(editor, name, statement)
            with connection.cursor() as cursor:
                cursor.execute(valid)
                assert cursor.fetchone() == (True,)
                cursor.execute(f"SELECT oid FROM pg_class WHERE relname = '{name}'")
                built = cursor.fetchone()
            migration._build_concurrently(editor, name, statement)  # valid: kept as it is
            with connection.cursor() as cursor:
                cursor.execute(f"SELECT oid FROM pg_class WHERE relname = '{name}'")
                assert cursor.fetchone() == built
    finally:
        with connection.cursor() as cursor:
            cursor.execute(f"DROP INDEX IF EXISTS {name}")


def _index_is_valid(name: str) -> bool | None:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT i.indisvalid FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid"
            " WHERE c.relname = %s",
            [name],
        )
        row = cursor.fetchone()
    return None if row is None else bool(row[0])


@postgres_only
@pytest.mark.django_db(transaction=True)
def test_migration_0008_runs_again_after_an_interrupted_build() -> None:
    """An interrupted 0008 leaves the column added and maybe the unique index INVALID:
    running it again keeps the column, builds the index again, and then keeps it."""
    import importlib

    migration = importlib.import_module("durable_agents.migrations.0008_run_start_key")
    first = durable_agents.start_run("tester", "t", key="k1")
    second = durable_agents.start_run("tester", "t", key="k2")
    try:
        with connection.cursor() as cursor:
            cursor.execute("DROP INDEX agent_run_start_key")
            AgentRun.objects.filter(pk=second.pk).update(start_key="k1")
            # A duplicate makes the build fail half-way, leaving the index INVALID.
            with pytest.raises(Exception, match="could not create unique index"):
                cursor.execute(migration.create_index_sql("CONCURRENTLY"))
        assert _index_is_valid("agent_run_start_key") is False
        AgentRun.objects.filter(pk=second.pk).update(start_key="k2")
    finally:
        with connection.schema_editor(atomic=False) as editor:
            migration.add_start_key(None, editor)
    assert _index_is_valid("agent_run_start_key") is True
    with connection.schema_editor(atomic=False) as editor:
        migration.add_start_key(None, editor)  # complete already: nothing to do
    assert durable_agents.start_run("tester", "t", key="k1").pk == first.pk
    with pytest.raises(IntegrityError):
        AgentRun.objects.filter(pk=second.pk).update(start_key="k1")


@pytest.mark.django_db(transaction=True)
def test_migration_0008_changes_nothing_when_run_again() -> None:
    import importlib

    migration = importlib.import_module("durable_agents.migrations.0008_run_start_key")
    run = durable_agents.start_run("tester", "t", key="k1")
    with connection.schema_editor(atomic=False) as editor:
        migration.add_start_key(None, editor)
    assert durable_agents.start_run("tester", "other", key="k1").pk == run.pk
    assert AgentRun.objects.get(pk=run.pk).start_key == "k1"


def _agent_run_indexes() -> set[str]:
    with connection.cursor() as cursor:
        return set(connection.introspection.get_constraints(cursor, "agent_run"))


@pytest.mark.django_db(transaction=True)
def test_migration_0009_runs_again_and_builds_what_is_missing() -> None:
    """0009 is not one transaction: run again after an interruption, it keeps the column and
    the indexes that exist and builds the ones that are missing (on SQLite too). It keeps the
    claim index of the previous release, which its workers read during a rolling deploy."""
    import importlib

    from django.apps import apps

    migration = importlib.import_module("durable_agents.migrations.0009_run_priority")
    run = durable_agents.start_run("tester", "t", priority=7)
    with connection.schema_editor(atomic=False) as editor:
        editor.execute('DROP INDEX IF EXISTS "agent_run_priority"')
    assert "agent_run_priority" not in _agent_run_indexes()
    with connection.schema_editor(atomic=False) as editor:
        migration.add_priority(apps, editor)
        migration.add_indexes(apps, editor)
        migration.add_indexes(apps, editor)  # and once more: nothing to do
    indexes = _agent_run_indexes()
    assert {"agent_run_priority", "agent_run_claim_priority", "agent_run_claim"} <= indexes
    assert AgentRun.objects.get(pk=run.pk).priority == 7
