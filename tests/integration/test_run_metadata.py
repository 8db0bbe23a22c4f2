"""Runs that carry their data: ``start_run(..., metadata={...})``, stored on ``agent_run`` in
the clear, found by containment (``with_metadata``), inherited by child runs and forks, and
refused, with nothing written, when it is not a small JSON object a database can store."""

from __future__ import annotations

import base64
import json
from typing import Any
from urllib.parse import urlencode

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext

from durable_agents import api
from durable_agents.api import MAX_METADATA_BYTES, check_metadata, start_run
from durable_agents.exceptions import InvalidArgument
from durable_agents.models import AgentRun, AgentStep, RunStatus
from durable_agents.testing import plan
from tests.conftest import run_worker
from tests.integration.test_admin import ESCAPED, SCRIPT, run_url
from tests.integration.test_admin_scale import listed
from tests.testapp import context_agents

pytestmark = pytest.mark.django_db(transaction=True)

TENANT = {"tenant": "acme", "user": {"id": 7, "roles": ["admin"]}, "order": 42}


def test_a_run_stores_its_metadata_and_reads_it_back() -> None:
    given = json.loads(json.dumps(TENANT))
    run = start_run("tester", "Look at order 42.", metadata=given)
    given["tenant"] = "changed by the caller later"  # the run keeps what it was given
    assert AgentRun.objects.get(pk=run.pk).metadata == TENANT
    assert start_run("tester", "No metadata.").metadata == {}
    assert AgentRun.objects.get(pk=start_run("tester", "Empty.", metadata={}).pk).metadata == {}


def test_with_metadata_finds_runs_by_containment() -> None:
    acme = start_run("tester", "one", metadata=TENANT)
    other = start_run("tester", "two", metadata={"tenant": "globex", "order": 42})
    start_run("tester", "three")
    assert set(AgentRun.objects.with_metadata(tenant="acme").values_list("pk", flat=True)) == {
        acme.pk
    }
    assert set(AgentRun.objects.with_metadata(order=42).values_list("pk", flat=True)) == {
        acme.pk,
        other.pk,
    }
    assert not AgentRun.objects.with_metadata(tenant="acme", order=43).exists()
    assert not AgentRun.objects.with_metadata(order="42").exists()  # JSON types count
    assert AgentRun.objects.with_metadata().count() == 3
    if connection.vendor == "postgresql":
        # A nested value matches when the run's value contains it.
        found = AgentRun.objects.with_metadata(user={"roles": ["admin"]})
        assert list(found.values_list("pk", flat=True)) == [acme.pk]


@pytest.mark.skipif("connection.vendor != 'postgresql'")
def test_with_metadata_uses_the_gin_index_on_postgresql() -> None:
    with connection.cursor() as cursor:
        cursor.execute("SELECT indexdef FROM pg_indexes WHERE indexname = 'agent_run_metadata'")
        (indexdef,) = cursor.fetchone()
    assert "gin" in indexdef.lower()
    assert "jsonb_path_ops" in indexdef
    # Without the default ordering, which a tiny table may prefer to serve from an index.
    query = AgentRun.objects.with_metadata(tenant="acme").order_by().values("pk")
    sql, params = query.query.sql_with_params()
    with connection.cursor() as cursor:
        cursor.execute("SET enable_seqscan = off")
        try:
            cursor.execute(f"EXPLAIN {sql}", params)
            explained = "\n".join(row[0] for row in cursor.fetchall())
        finally:
            cursor.execute("RESET enable_seqscan")
    assert "agent_run_metadata" in explained


def test_metadata_is_stored_in_the_clear_under_encryption(da_settings: Any) -> None:
    """Metadata is for searching: in the clear, while the task beside it is sealed."""
    da_settings(ENCRYPTION_KEYS=[base64.urlsafe_b64encode(b"M" * 32).decode()])
    run = start_run("tester", "Secret task for acme.", metadata={"tenant": "acme"})
    pk = AgentRun._meta.pk.get_db_prep_value(run.pk, connection)
    with connection.cursor() as cursor:
        cursor.execute("SELECT metadata FROM agent_run WHERE id = %s", [pk])
        (raw,) = cursor.fetchone()
        cursor.execute("SELECT payload FROM agent_step WHERE run_id = %s", [pk])
        (task_payload,) = cursor.fetchone()
    stored = raw if isinstance(raw, dict) else json.loads(raw)
    assert stored == {"tenant": "acme"}
    assert "Secret task" not in str(task_payload)  # the task step is encrypted
    assert AgentRun.objects.with_metadata(tenant="acme").get().pk == run.pk


BAD = [
    pytest.param(["tenant", "acme"], "is a dict", id="a-list"),
    pytest.param("tenant=acme", "is a dict", id="a-string"),
    pytest.param({1: "acme"}, "keys are strings", id="an-int-key"),
    pytest.param({"when": object()}, "not a JSON value", id="an-object"),
    pytest.param({"when": {1, 2}}, "not a JSON value", id="a-set"),
    pytest.param({"ratio": float("nan")}, "JSON cannot hold", id="nan"),
    pytest.param({"ratio": float("inf")}, "JSON cannot hold", id="infinity"),
    pytest.param({"t\x00": "acme"}, "NUL", id="nul-in-a-key"),
    pytest.param({"tenant": "ac\x00me"}, "NUL", id="nul-in-a-value"),
    pytest.param({"tenant": ["ok", "\ud800"]}, "lone surrogate", id="surrogate-in-a-list"),
    pytest.param({"\udfff": 1}, "lone surrogate", id="surrogate-in-a-key"),
    pytest.param({"blob": "x" * MAX_METADATA_BYTES}, "at most", id="over-64kB"),
    pytest.param({"blob": "é" * (MAX_METADATA_BYTES // 2)}, "at most", id="over-64kB-as-utf8"),
]


def _deep(levels: int) -> dict[str, Any]:
    value: dict[str, Any] = {}
    for _ in range(levels - 1):
        value = {"a": value}
    return value


@pytest.mark.parametrize(("metadata", "says"), BAD)
def test_bad_metadata_is_refused_and_nothing_is_written(metadata: Any, says: str) -> None:
    with pytest.raises(InvalidArgument, match=says):
        start_run("tester", "Refused.", metadata=metadata)
    assert not AgentRun.objects.exists()
    assert not AgentStep.objects.exists()


def test_metadata_deeper_than_100_levels_is_refused() -> None:
    check_metadata(_deep(100))
    with pytest.raises(InvalidArgument, match="deeper than 100"):
        start_run("tester", "Refused.", metadata=_deep(101))
    with pytest.raises(InvalidArgument, match="deeper than 100"):
        start_run("tester", "Refused.", metadata=_deep(100_000))  # no RecursionError
    assert not AgentRun.objects.exists()


def test_metadata_of_64kB_exactly_is_taken() -> None:
    overhead = len(json.dumps({"blob": ""}, separators=(",", ":")))
    run = start_run("tester", "Big.", metadata={"blob": "x" * (MAX_METADATA_BYTES - overhead)})
    assert len(AgentRun.objects.get(pk=run.pk).metadata["blob"]) == MAX_METADATA_BYTES - overhead


def test_a_debounced_call_replaces_the_metadata() -> None:
    first = start_run("tester", "one", key="k", debounce=30, metadata={"v": 1})
    again = start_run("tester", "two", key="k", debounce=30, metadata={"v": 2})
    assert again.pk == first.pk
    assert AgentRun.objects.get(pk=first.pk).metadata == {"v": 2}


def test_a_child_run_inherits_its_parents_metadata_unless_given_its_own() -> None:
    task = plan(
        ("delegate", {"task": plan(task="Inherit.")}),
        ("delegate", {"task": plan(task="Own."), "own": {"tenant": "child"}}),
    )
    parent = start_run("contextual", task, metadata=TENANT)
    run_worker()
    parent.refresh_from_db()
    assert parent.status == RunStatus.SUCCEEDED, parent.error
    children = {c.task: c.metadata for c in AgentRun.objects.filter(parent_id=parent.pk)}
    assert children == {plan(task="Inherit."): TENANT, plan(task="Own."): {"tenant": "child"}}


def test_a_fork_keeps_its_parents_metadata() -> None:
    run = start_run("tester", plan(("lookup", {"key": "a"})), metadata=TENANT)
    run_worker()
    run.refresh_from_db()
    assert run.status == RunStatus.SUCCEEDED, run.error
    fork = api.fork_run(run.pk, 0)
    assert AgentRun.objects.get(pk=fork.pk).metadata == TENANT


def test_run_context_in_a_real_run_sees_the_run_and_its_metadata(
    caplog: pytest.LogCaptureFixture,
) -> None:
    context_agents.SEEN.clear()
    task = plan(("whoami", {"note": "sync"}), ("awhoami", {"note": "async"}))
    run = start_run(
        "contextual", task, metadata=TENANT, key="order:42", concurrency_key="tenant:acme"
    )
    with caplog.at_level("INFO", logger="durable_agents.tools"):
        run_worker()
    run.refresh_from_db()
    assert run.status == RunStatus.SUCCEEDED, run.error
    expected = {
        "id": str(run.pk),
        "agent": "contextual",
        "version": "v1",
        "metadata": TENANT,
        "key": "order:42",
        "concurrency_key": "tenant:acme",
        "attempt": run.attempt,
    }
    assert [{k: v for k, v in s.items() if k != "note"} for s in context_agents.SEEN] == [
        expected,
        expected,
    ]
    assert [s["note"] for s in context_agents.SEEN] == ["sync", "async"]
    records = [r for r in caplog.records if r.getMessage().startswith("looked at the run")]
    assert [r.name for r in records] == [
        "durable_agents.tools.whoami",
        "durable_agents.tools.awhoami",
    ]
    assert {getattr(r, "run_id", None) for r in records} == {str(run.pk)}
    context = context_agents.CONTEXTS[-1]
    with pytest.raises(TypeError):
        context.metadata["tenant"] = "other"  # type: ignore[index]
    with pytest.raises(AttributeError):
        context.agent = "other"  # type: ignore[misc]


def test_run_agent_passes_metadata_to_the_run_and_its_tools() -> None:
    from durable_agents.testing import run_agent

    context_agents.SEEN.clear()
    result = run_agent("contextual", plan(("whoami", {"note": "t"})), metadata={"tenant": "t"})
    assert result.status == RunStatus.SUCCEEDED, result.error
    assert result.run.metadata == {"tenant": "t"}
    assert context_agents.SEEN[-1]["metadata"] == {"tenant": "t"}


def test_the_model_cannot_set_the_run_context() -> None:
    context_agents.SEEN.clear()
    run = start_run("contextual", plan(("whoami", {"note": "x", "ctx": {"agent": "forged"}})))
    run_worker()
    run.refresh_from_db()
    assert run.status == RunStatus.SUCCEEDED, run.error
    assert context_agents.SEEN == []  # the call was an is_error result the model saw


# -- the admin ------------------------------------------------------------------------------


def test_the_run_page_shows_the_metadata_escaped(admin_client: Client) -> None:
    run = start_run("tester", "t", metadata={"tenant": SCRIPT, "order": 42})
    content = admin_client.get(run_url(run)).content.decode()
    assert "metadata" in content
    assert ESCAPED in content
    assert SCRIPT not in content
    plain = start_run("tester", "no metadata")
    assert "searchable with meta:" not in admin_client.get(run_url(plain)).content.decode()


def test_the_runs_list_finds_runs_by_metadata_in_the_same_queries(admin_client: Client) -> None:
    acme = start_run("tester", "Refund the order", metadata={"tenant": "acme", "order": 42})
    globex = start_run("tester", "Refund the order", metadata={"tenant": "globex", "order": "42"})
    start_run("tester", "Refund the order")

    def search(term: str) -> tuple[list[Any], int]:
        with CaptureQueriesContext(connection) as queries:
            found = listed(admin_client, "?" + urlencode({"q": term}))
        return found, len(queries)

    assert search("meta:tenant=acme")[0] == [acme.pk]
    assert set(search("meta:order=42")[0]) == {acme.pk, globex.pk}  # 42 and "42"
    assert search("meta:tenant=acme meta:order=42")[0] == [acme.pk]
    assert search("meta:tenant=initech")[0] == []
    assert search("meta:tenant=acme Refund")[0] == [acme.pk]  # and words of the task
    # No query more than the list without a search.
    assert search("meta:tenant=acme")[1] == len_of_plain_list(admin_client)


def len_of_plain_list(admin_client: Client) -> int:
    with CaptureQueriesContext(connection) as queries:
        listed(admin_client, "")
    return len(queries)


@pytest.mark.skipif("connection.vendor != 'postgresql'")
def test_the_metadata_search_is_a_containment_the_index_serves(admin_client: Client) -> None:
    start_run("tester", "t", metadata={"tenant": "acme"})
    with CaptureQueriesContext(connection) as queries:
        listed(admin_client, "?" + urlencode({"q": "meta:tenant=acme"}))
    sql = "\n".join(q["sql"] for q in queries.captured_queries)
    assert '"agent_run"."metadata" @> ' in sql
