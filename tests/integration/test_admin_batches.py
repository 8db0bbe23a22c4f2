"""Message Batches in the admin, through the real admin and the offline model's Batches API:
the batches list (counts, runs, cost and what it saved) and a batch's page with its requests,
view only; a run's page saying which batch its waiting turn is in; and the operations page
counting today's model turns sent directly and in batches. The API's words (a request's
reason) are escaped; the list's queries do not grow with its rows."""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib.auth.models import Permission
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from durable_agents import api, store
from durable_agents._internal.interrupt import Interrupt
from durable_agents.admin import batches as batches_admin
from durable_agents.batches import Submitter, poll_due
from durable_agents.engine.runner import advance_run
from durable_agents.flow.pricing import format_usd
from durable_agents.models import (
    AgentBatch,
    AgentBatchRequest,
    AgentRun,
    BatchStatus,
    RequestStatus,
    RunStatus,
    WaitKind,
    short_id,
)
from durable_agents.testing import drive, plan
from tests.integration.test_admin import ESCAPED, SCRIPT, run_url

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("desk")]

PRICES = {"claude-test-1": {"input": 3.0, "output": 15.0}}


@pytest.fixture
def batch_viewer(django_user_model: Any) -> Any:
    """Staff who may look at batches and runs, and nothing else."""
    user = django_user_model.objects.create_user("batchviewer", password="pw", is_staff=True)
    user.user_permissions.add(
        *Permission.objects.filter(
            codename__in=["view_agentbatch", "view_agentrun"],
            content_type__app_label="durable_agents",
        )
    )
    return django_user_model.objects.get(pk=user.pk)


@pytest.fixture
def viewer_client(batch_viewer: Any) -> Client:
    client = Client()
    client.force_login(batch_viewer)
    return client


def batches_url(suffix: str = "") -> str:
    return reverse("admin:durable_agents_agentbatch_changelist") + suffix


def batch_url(batch: AgentBatch, view: str = "change") -> str:
    return reverse(f"admin:durable_agents_agentbatch_{view}", args=[batch.pk])


def operations_url() -> str:
    return reverse("admin:durable_agents_agentrun_operations")


def park(count: int, label: str = "a") -> list[AgentRun]:
    """``count`` runs in batches, each parked on its first model turn (its request waits for
    the submitter)."""
    runs = []
    for i in range(count):
        run = api.start_run("tester", plan(("lookup", {"key": f"{label}{i}"})), batch=True)
        claim = store.current().claim_run(run.pk, "w", 30)
        assert claim is not None
        advance_run(claim, Interrupt())
        run.refresh_from_db()
        assert run.status == RunStatus.WAITING
        assert run.waiting_for == WaitKind.BATCH
        runs.append(run)
    return runs


def one_batch(count: int, label: str = "a") -> tuple[AgentBatch, list[AgentRun]]:
    """``count`` parked runs whose turns are submitted together in one batch (not polled)."""
    runs = park(count, label)
    assert Submitter("w").submit_due(force=True).batches == 1
    request = AgentBatchRequest.objects.get(run=runs[0])
    assert request.batch is not None
    return request.batch, runs


def api_id(batch: AgentBatch) -> str:
    """The batch's id at the API (every batch the offline API accepted has one)."""
    assert batch.provider_id
    return batch.provider_id


def page(client: Client, url: str) -> str:
    response = client.get(url)
    assert response.status_code == 200, response.status_code
    return response.content.decode()


def queries(client: Client, url: str) -> list[str]:
    with CaptureQueriesContext(connection) as ctx:
        assert client.get(url).status_code == 200
    return [q["sql"] for q in ctx.captured_queries]


# ---------------------------------------------------------------------------------------------
# The batches list and a batch's page


def test_the_list_shows_each_batch_with_its_counts_runs_cost_and_saving(
    admin_client: Client, da_settings: Any
) -> None:
    da_settings(PRICES=PRICES)
    batch, runs = one_batch(3)
    assert poll_due("w", force=True).committed == 3
    batch.refresh_from_db()
    assert batch.status == BatchStatus.ENDED
    assert batch.provider_id
    assert batch.cost_usd is not None
    assert batch.cost_usd > 0
    assert batch.direct_cost_usd == batch.cost_usd * 2
    for run in runs:  # each one's second turn, alone in a batch of its own
        assert drive(run).status == RunStatus.SUCCEEDED

    response = admin_client.get(batches_url())
    assert response.status_code == 200
    shown = {row.pk: row for row in response.context["cl"].result_list}
    assert len(shown) == 4
    assert shown[batch.pk].runs_count == 3
    content = response.content.decode()
    assert api_id(batch) in content
    assert format_usd(batch.cost_usd) in content
    assert format_usd(batch.direct_cost_usd - batch.cost_usd) in content  # saved
    others = [b for pk, b in shown.items() if pk != batch.pk]
    assert all(b.runs_count == 1 and b.requests == 1 for b in others)
    assert all(b.status == BatchStatus.ENDED for b in shown.values())
    # Filtered by status.
    ended = admin_client.get(batches_url("?status__exact=ended"))
    assert len(ended.context["cl"].result_list) == 4
    in_progress = admin_client.get(batches_url("?status__exact=in_progress"))
    assert list(in_progress.context["cl"].result_list) == []


def test_a_batch_page_lists_its_requests_with_their_runs(admin_client: Client) -> None:
    batch, runs = one_batch(2)
    content = page(admin_client, batch_url(batch))
    assert api_id(batch) in content
    for run in runs:
        request = AgentBatchRequest.objects.get(run=run)
        assert f"<code>{request.custom_id}</code>" in content
        assert f'href="{run_url(run)}"' in content
        assert short_id(run.pk) in content
    assert content.count('class="da-batch-request"') == 2
    assert "Submitted" in content
    # Nothing to save, change or delete: a read-only page.
    assert 'name="_save"' not in content
    assert "deletelink" not in content


def test_a_batch_page_lists_a_bounded_number_of_requests(
    admin_client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(batches_admin, "REQUESTS_SHOWN", 2)
    batch, _runs = one_batch(5)
    content = page(admin_client, batch_url(batch))
    assert content.count('class="da-batch-request"') == 2
    assert "3 more requests not listed." in content


def test_a_request_reason_from_the_api_is_escaped(admin_client: Client) -> None:
    batch, runs = one_batch(1)
    AgentBatchRequest.objects.filter(run=runs[0]).update(reason=f"overloaded {SCRIPT}", tries=2)
    AgentBatch.objects.filter(pk=batch.pk).update(error=f"retrieve failed {SCRIPT}")
    for url in (batch_url(batch), run_url(runs[0])):
        content = page(admin_client, url)
        assert ESCAPED in content
        assert SCRIPT not in content


def test_the_list_runs_the_same_queries_whatever_its_rows(admin_client: Client) -> None:
    one_batch(2, "a")
    admin_client.get(batches_url())  # caches (content types) warmed
    small = len(queries(admin_client, batches_url()))
    for label in "bcdef":
        one_batch(3, label)
    response = admin_client.get(batches_url())
    assert len(response.context["cl"].result_list) == 6
    large = queries(admin_client, batches_url())
    assert len(large) == small, large
    # No query reads the requests of one batch: the runs are counted in the list's statement.
    assert not any(sql.lstrip().startswith('SELECT "agent_batch_request"') for sql in large)


# ---------------------------------------------------------------------------------------------
# Permissions


def test_a_viewer_sees_batches_and_cannot_add_change_or_delete(
    viewer_client: Client, admin_client: Client
) -> None:
    batch, _runs = one_batch(1)
    assert api_id(batch) in page(viewer_client, batches_url())
    assert api_id(batch) in page(viewer_client, batch_url(batch))
    for client in (viewer_client, admin_client):
        assert client.get(reverse("admin:durable_agents_agentbatch_add")).status_code == 403
        assert client.get(batch_url(batch, "delete")).status_code == 403
        posted = client.post(batch_url(batch), {"status": BatchStatus.ENDED})
        assert posted.status_code == 403
    batch.refresh_from_db()
    assert batch.status == BatchStatus.IN_PROGRESS


def test_staff_without_the_view_permission_get_no_batches(django_user_model: Any) -> None:
    batch, _runs = one_batch(1)
    user = django_user_model.objects.create_user("nobody", password="pw", is_staff=True)
    client = Client()
    client.force_login(user)
    assert client.get(batches_url()).status_code == 403
    assert client.get(batch_url(batch)).status_code == 403


def test_malformed_or_unknown_batch_ids_are_not_a_500(admin_client: Client) -> None:
    for object_id in ("nope", "999999", "9" * 40):
        url = reverse("admin:durable_agents_agentbatch_change", args=[object_id])
        assert admin_client.get(url).status_code in (302, 404)


# ---------------------------------------------------------------------------------------------
# A run's page


def test_a_run_page_says_which_batch_its_turn_waits_in(admin_client: Client) -> None:
    (run,) = park(1)
    request = AgentBatchRequest.objects.get(run=run)
    content = page(admin_client, run_url(run))
    assert "in batches" in content
    assert 'id="wait-batch"' in content
    assert "Waiting for the submitter to put it into a batch" in content
    assert f"request {request.custom_id} (waiting)" in content

    assert Submitter("w").submit_due(force=True).batches == 1
    request.refresh_from_db()
    batch = request.batch
    assert batch is not None
    assert request.status == RequestStatus.SUBMITTED
    AgentBatchRequest.objects.filter(pk=request.pk).update(tries=2, reason="the batch expired")
    content = page(admin_client, run_url(run))
    assert f'href="{batch_url(batch)}" id="wait-batch-link"' in content
    assert f"<code>{batch.provider_id}</code>" in content
    assert f"request {request.custom_id} (submitted)" in content
    assert "2 tries" in content
    assert "Sent again: the batch expired" in content
    assert "submitted " in content


def test_a_run_page_reads_the_batch_only_for_a_run_waiting_on_one(
    admin_client: Client, django_assert_max_num_queries: Any
) -> None:
    done = api.start_run("tester", plan(("lookup", {"key": "d"})), batch=True)
    assert drive(done).status == RunStatus.SUCCEEDED
    direct = api.start_run("tester", plan(("lookup", {"key": "e"})))
    assert drive(direct).status == RunStatus.SUCCEEDED
    # Parked after the drives (each polls every batch at the API).
    (waiting,) = park(1, "w")
    assert Submitter("w").submit_due(force=True).batches == 1
    admin_client.get(run_url(direct))  # caches (content types) warmed

    def batch_reads(run: AgentRun) -> int:
        return sum('"agent_batch_request"' in sql for sql in queries(admin_client, run_url(run)))

    assert batch_reads(waiting) == 1
    assert batch_reads(done) == 0
    assert batch_reads(direct) == 0
    assert "in batches" in page(admin_client, run_url(done))
    assert "in batches" not in page(admin_client, run_url(direct))
    # The run page's bound (16), and one more for the batch its turn waits in.
    with django_assert_max_num_queries(17):
        admin_client.get(run_url(waiting))


# ---------------------------------------------------------------------------------------------
# The operations page


def test_the_operations_page_counts_todays_turns_direct_and_in_batches(
    admin_client: Client, da_settings: Any
) -> None:
    da_settings(PRICES=PRICES)
    direct = api.start_run("tester", plan(("lookup", {"key": "a"})))
    batched = api.start_run(
        "tester", plan(("lookup", {"key": "b"}), ("lookup", {"key": "c"})), batch=True
    )
    batched_too = api.start_run("tester", plan(("lookup", {"key": "d"})), batch=True)
    for run in (direct, batched, batched_too):
        assert drive(run).status == RunStatus.SUCCEEDED
    response = admin_client.get(operations_url())
    assert response.status_code == 200
    assert response.context["turns_today_direct"] == 2
    assert response.context["turns_today_batched"] == 5
    content = response.content.decode()
    assert "Model turns today (UTC): 2 direct, 5 in batches" in content


def test_the_operations_page_reads_no_batch_and_no_more_with_more_batches(
    admin_client: Client,
) -> None:
    def batched_day(label: str, parked: int) -> None:
        run = api.start_run("tester", plan(("lookup", {"key": label})), batch=True)
        assert drive(run).status == RunStatus.SUCCEEDED
        one_batch(parked, label)

    batched_day("a", 1)
    admin_client.get(operations_url())  # caches (content types) warmed
    before = queries(admin_client, operations_url())
    for label in "bcd":
        batched_day(label, 3)
    after = queries(admin_client, operations_url())
    assert len(after) == len(before)
    # Today's turns come with the costs' read of the rollup: no query of the batch tables.
    assert not any('"agent_batch' in sql for sql in after)
