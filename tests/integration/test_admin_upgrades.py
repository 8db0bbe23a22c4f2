"""Upgrades in the admin: the runs list's "Upgrade to version…" with its intermediate page,
"Carry over to version…" on a dead run's page and on the dead letter's group of a run whose
version is not deployed or drifted; through the real admin, with its permission, CSRF, audit
record and escaped messages."""

from __future__ import annotations

import datetime
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlencode

import pytest
from django.contrib.admin.models import CHANGE, LogEntry
from django.contrib.auth.models import Permission
from django.test import Client
from django.urls import reverse
from django.utils import timezone
from django.utils.html import escape

from durable_agents.causes import dead_cause
from durable_agents.models import AgentRun, RunStatus, short_id
from tests.integration.conftest import agents_registered
from tests.integration.test_admin import hidden_fields, messages_of, run_url, runs_url
from tests.integration.test_upgrades import (
    AGENTS,
    PLAIN_LOG,
    THOUGHT_LOG,
    UNDEPLOYED,
    run_with,
)

pytestmark = pytest.mark.django_db

SCRIPT = "<script>alert(1)</script>"


@pytest.fixture(autouse=True)
def registered() -> Iterator[None]:
    with agents_registered(*AGENTS):
        yield


def action_post(runs: list[AgentRun], **extra: Any) -> dict[str, Any]:
    return {"action": "upgrade_runs", "_selected_action": [str(r.pk) for r in runs], **extra}


def carry_over_url(run: AgentRun) -> str:
    return reverse("admin:durable_agents_agentrun_carry_over", args=[run.pk])


def group_url(run: AgentRun) -> str:
    cause = AgentRun.objects.get(pk=run.pk).dead_cause
    return (
        reverse("admin:durable_agents_agentrun_dead_letter_carry_over")
        + "?"
        + (urlencode({"cause": cause}))
    )


def dead(reason: str, *log: tuple[str, str]) -> AgentRun:
    return run_with(
        *(log or PLAIN_LOG), status=RunStatus.DEAD, error=reason, dead_cause=dead_cause(reason)
    )


def staff(django_user_model: Any, *codenames: str) -> Client:
    user = django_user_model.objects.create_user("viewer", is_staff=True)
    for codename in codenames:
        user.user_permissions.add(
            Permission.objects.get(codename=codename, content_type__app_label="durable_agents")
        )
    client = Client()
    client.force_login(user)
    return client


def test_without_the_change_permission_nothing_is_offered_nor_done(
    django_user_model: Any,
) -> None:
    client = staff(django_user_model, "view_agentrun")
    pending = run_with(*PLAIN_LOG)
    undeployed = dead(UNDEPLOYED)

    listing = client.get(runs_url()).content.decode()
    assert "upgrade_runs" not in listing
    response = client.post(runs_url(), action_post([pending], post="yes", version="2"))
    assert response.status_code in (200, 302)
    page = client.get(run_url(undeployed)).content.decode()
    assert carry_over_url(undeployed) not in page
    assert client.get(carry_over_url(undeployed)).status_code == 403
    assert client.post(carry_over_url(undeployed), {"post": "yes", "version": "2"}).status_code == (
        403
    )
    assert client.get(group_url(undeployed)).status_code == 403
    dead_letter = client.get(reverse("admin:durable_agents_agentrun_dead_letter")).content
    assert b"Carry over to version" not in dead_letter
    assert AgentRun.objects.filter(prompt_version="1").count() == 2
    assert not LogEntry.objects.exists()


def test_the_action_lists_the_runs_offers_the_versions_and_moves_them(
    admin_client: Client, superuser: Any
) -> None:
    plain = run_with(*PLAIN_LOG)
    thought = run_with(*THOUGHT_LOG)
    succeeded = run_with(*PLAIN_LOG, status=RunStatus.SUCCEEDED)

    page = admin_client.post(runs_url(), action_post([plain, thought, succeeded]))
    html = page.content.decode()
    assert page.status_code == 200
    assert 'name="version"' in html
    # The other versions of the agent, each said to keep or change what thinking binds.
    assert '<option value="1-roomier"' in html
    assert '<option value="2"' in html
    assert '<option value="1"' not in html
    assert "another system prompt or other tools: runs with signed thinking stay" in html
    assert "the same system prompt and tools: runs with thinking move too" in html
    # Version 3 declares lookup with another effect class.
    assert "declared otherwise: lookup (runs whose pending calls use them stay)" in html
    # The finished run is listed as left out, and not posted.
    fields = hidden_fields(page)
    assert sorted(fields["_selected_action"]) == sorted([str(plain.pk), str(thought.pk)])
    assert "succeeded: only runs in flight or dead move" in html

    response = admin_client.post(runs_url(), {**fields, "version": "2"}, follow=True)
    said = messages_of(response)
    assert said[0] == "Moved 1 run to version 2."
    assert said[1].startswith(f"Not moved: run {short_id(thought.pk)}: cannot upgrade onto a")
    assert "step 1 (a model turn), content block 0 (thinking)" in said[1]
    assert AgentRun.objects.get(pk=plain.pk).prompt_version == "2"
    assert AgentRun.objects.get(pk=thought.pk).prompt_version == "1"
    [entry] = LogEntry.objects.all()
    assert (entry.object_id, entry.action_flag, entry.user_id) == (
        str(plain.pk),
        CHANGE,
        superuser.pk,
    )
    assert "Upgraded from the admin: version '1' -> '2'." in entry.get_change_message()


def test_runs_of_several_versions_are_not_upgraded_together(admin_client: Client) -> None:
    one = run_with(*PLAIN_LOG)
    other = run_with(*PLAIN_LOG, on=AGENTS[1])
    response = admin_client.post(runs_url(), action_post([one, other]), follow=True)
    [said] = messages_of(response)
    assert "the selected runs are of several agent versions" in said
    assert "upgrader @ 1, upgrader @ 1-roomier" in said
    assert 'name="version"' not in response.content.decode()


def test_a_post_needs_its_csrf_token(superuser: Any) -> None:
    run = run_with(*PLAIN_LOG)
    client = Client(enforce_csrf_checks=True)
    client.force_login(superuser)
    yes = action_post([run], post="yes", version="2", select_across="0")
    assert client.post(runs_url(), yes).status_code == 403
    assert AgentRun.objects.get(pk=run.pk).prompt_version == "1"
    client.get(runs_url())
    token = client.cookies["csrftoken"].value
    response = client.post(runs_url(), {**yes, "csrfmiddlewaretoken": token})
    assert response.status_code == 302
    assert AgentRun.objects.get(pk=run.pk).prompt_version == "2"


def test_a_refusal_is_shown_escaped(admin_client: Client) -> None:
    held = run_with(
        *PLAIN_LOG,
        status=RunStatus.RUNNING,
        lease_owner=SCRIPT,
        lease_until=timezone.now() + datetime.timedelta(minutes=5),
        attempt=1,
    )
    response = admin_client.post(
        runs_url(), action_post([held], post="yes", version="2"), follow=True
    )
    html = response.content.decode()
    assert SCRIPT not in html
    assert escape(f"held by worker '{SCRIPT}'") in html
    assert AgentRun.objects.get(pk=held.pk).prompt_version == "1"


def test_a_dead_runs_page_offers_a_carry_over_instead_of_a_requeue(
    admin_client: Client, superuser: Any
) -> None:
    undeployed = dead(UNDEPLOYED)
    other = dead("the model stopped with stop_reason='refusal'")

    page = admin_client.get(run_url(undeployed)).content.decode()
    assert carry_over_url(undeployed) in page
    assert reverse("admin:durable_agents_agentrun_requeue", args=[undeployed.pk]) not in page
    page = admin_client.get(run_url(other)).content.decode()
    assert reverse("admin:durable_agents_agentrun_requeue", args=[other.pk]) in page
    assert carry_over_url(other) not in page

    form = admin_client.get(carry_over_url(undeployed))
    assert form.status_code == 200
    assert '<option value="2"' in form.content.decode()
    response = admin_client.post(
        carry_over_url(undeployed), {**hidden_fields(form), "version": "2"}
    )
    assert response.status_code == 302
    assert response["Location"] == run_url(undeployed)
    undeployed.refresh_from_db()
    assert (undeployed.status, undeployed.prompt_version, undeployed.dead_cause) == (
        RunStatus.PENDING,
        "2",
        "",
    )
    [entry] = LogEntry.objects.all()
    assert entry.user_id == superuser.pk
    assert "Carried over from the dead letter from the admin" in entry.get_change_message()


def test_the_dead_letters_group_of_an_undeployed_version_is_carried_over(
    admin_client: Client,
) -> None:
    first, second = dead(UNDEPLOYED), dead(UNDEPLOYED)
    thought = dead(UNDEPLOYED, *THOUGHT_LOG)
    refused = dead("the model stopped with stop_reason='refusal'")

    letter = admin_client.get(reverse("admin:durable_agents_agentrun_dead_letter"))
    html = letter.content.decode()
    assert html.count("Carry over to version…") == 1
    assert html.count("Requeue…") == 1

    page = admin_client.get(group_url(first))
    assert page.status_code == 200
    fields = hidden_fields(page)
    assert sorted(fields["_selected_action"]) == sorted(str(r.pk) for r in (first, second, thought))
    response = admin_client.post(group_url(first), {**fields, "version": "2"}, follow=True)
    said = messages_of(response)
    assert said[0] == "Moved 2 runs to version 2."
    assert "content block 0 (thinking)" in said[1]
    assert set(AgentRun.objects.filter(prompt_version="2").values_list("pk", flat=True)) == {
        first.pk,
        second.pk,
    }
    assert AgentRun.objects.get(pk=refused.pk).status == RunStatus.DEAD
