"""The admin speaks the user's language: with German active (LocaleMiddleware and
Accept-Language, or LANGUAGE_CODE) the runs list, a run page, the operations page, the
schedules list, messages and staff mails are German, from the catalogue in
durable_agents/locale; what the model, a tool or a person wrote is never translated and stays
escaped."""

from __future__ import annotations

import datetime
from collections.abc import Iterator
from typing import Any

import pytest
from django.conf import settings as django_settings
from django.test import Client
from django.utils import timezone, translation
from django.utils.functional import Promise

import durable_agents
from durable_agents import notifications
from durable_agents.admin import format as views
from durable_agents.models import AgentRun, RunStatus, WaitKind
from tests.integration.test_admin import ESCAPED, SCRIPT, messages_of, run_url, runs_url
from tests.integration.test_admin_schedules import list_url, make
from tests.integration.test_admin_waits import operations_url, park, park_on_question

pytestmark = pytest.mark.django_db

LOCALE_MIDDLEWARE = "django.middleware.locale.LocaleMiddleware"


def _with_locale_middleware(middleware: list[str]) -> list[str]:
    """LocaleMiddleware where Django's documentation puts it: after sessions, before common."""
    chain = [m for m in middleware if m != LOCALE_MIDDLEWARE]
    chain.insert(
        chain.index("django.contrib.sessions.middleware.SessionMiddleware") + 1, LOCALE_MIDDLEWARE
    )
    return chain


@pytest.fixture
def german_client(settings: Any, admin_client: Client) -> Iterator[Client]:
    """A superuser whose browser asks for German, in a project with LocaleMiddleware."""
    settings.MIDDLEWARE = _with_locale_middleware(list(settings.MIDDLEWARE))
    admin_client.defaults["HTTP_ACCEPT_LANGUAGE"] = "de"
    yield admin_client
    translation.deactivate()  # LocaleMiddleware leaves the thread's language active


@pytest.fixture
def german_site(settings: Any) -> Iterator[None]:
    """A project whose language is German (no LocaleMiddleware)."""
    settings.LANGUAGE_CODE = "de"
    translation.deactivate()  # nothing active: the project's language applies
    yield
    translation.deactivate()


def page(client: Client, url: str) -> str:
    response = client.get(url)
    assert response.status_code == 200, url
    return response.content.decode()


def hostile_waiting_run() -> AgentRun:
    """A run waiting on an event, whose task (long, so the page cuts it) and event name are
    markup: what the model or a tool wrote, never translated, always escaped."""
    run = park(WaitKind.EVENT, wait_event=f"deploy:{SCRIPT}")
    AgentRun.objects.filter(pk=run.pk).update(task=f"{SCRIPT} Deploy it.\n" + "x" * 5_000)
    return AgentRun.objects.get(pk=run.pk)


def test_the_runs_list_is_german_and_model_output_stays_escaped(german_client: Client) -> None:
    hostile_waiting_run()
    failed = durable_agents.start_run("tester", f"{SCRIPT} Migrate.")
    AgentRun.objects.filter(pk=failed.pk).update(status=RunStatus.FAILED, error=SCRIPT)
    content = page(german_client, runs_url())

    assert 'lang="de"' in content
    assert "Django-Systemverwaltung" in content  # Django's own catalogue: German is active
    for german in (
        "Betrieb",  # object tools
        "Einen Lauf starten",
        "Dead Letter (",
        "Ausgewählte Läufe abbrechen",  # actions
        "Ausgewählte tote Läufe erneut einreihen",
        "Das Ereignis senden, auf das diese Läufe warten",
        "wartet auf",  # a filter
        "Eltern-Lauf",
        "direkt gestartet",
        "Übernahmen",  # column headers
        "Aufgabe",
        "wartet auf das Ereignis „deploy:",  # what the waiting run waits for
        "Fehlgeschlagen",  # the short status badge
        "vor ",  # the age under each run id
    ):
        assert german in content, german
    for english in ("Start a run", "Cancel selected runs", "waits for event", "started directly"):
        assert english not in content, english
    assert SCRIPT not in content
    assert ESCAPED in content


def test_a_run_page_is_german_and_model_output_stays_escaped(german_client: Client) -> None:
    run = hostile_waiting_run()
    content = page(german_client, run_url(run))

    for german in (
        "Wartet auf das Ereignis „deploy:",  # the wait box
        "Ereignis <strong",
        "Dieses Ereignis senden",
        "Nutzdaten (JSON; leer für null)",
        "Diesen Lauf abbrechen",
        "Fortschritt",  # fieldsets and labels
        "Übernahmen",
        "Verbrauchte Tokens",  # (the admin capitalises labels)
        "Erstellt am",
        "Verlauf (1 Schritt)",  # the transcript
        "· Übernahme 0",
        "[gekürzt: <a href=",  # a cut text, linked to the whole
        "der ganze Text (",
        "Dieselben Zeilen aus einer Datenbank-Shell:",
    ):
        assert german in content, german
    for english in ("Waiting for event", "Cancel this run", "Transcript (", "the whole text"):
        assert english not in content, english
    assert SCRIPT not in content
    assert ESCAPED in content
    assert f"deploy:{ESCAPED}" in content  # the event's name: as the run wrote it, escaped


def test_the_operations_page_is_german_and_a_question_stays_escaped(
    german_client: Client,
) -> None:
    park(WaitKind.TIMER, wake_at=timezone.now() + datetime.timedelta(hours=1))
    park_on_question(f"{SCRIPT} Which region?")
    durable_agents.start_run("tester", "Pending work")
    content = page(german_client, operations_url())

    for german in (
        "Läufe nach Status",
        "ausstehend: 1",  # a status, linked to the list by its value
        "?status__exact=pending",
        "Warteschlange",
        "Ältester ausstehender Lauf",
        "Wartende Läufe nach dem, worauf sie warten (2)",
        "wartet auf",
        "einen Timer",  # the label of a kind of wait comes from models.py once it is wrapped
        "Offene Fragen",
        "gefragt vor",
        "Übernahmen pro Lauf",
        "Beendete Läufe pro Stunde",
        "jetzt",
    ):
        if german == "einen Timer" and not isinstance(WaitKind.TIMER.label, Promise):
            continue  # models.py's choice labels are not marked for translation (yet)
        assert german in content, german
    assert "Runs by status" not in content
    assert SCRIPT not in content
    assert ESCAPED in content


def test_a_project_in_german_needs_no_middleware(german_site: None, admin_client: Client) -> None:
    hostile_waiting_run()
    content = page(admin_client, runs_url())
    assert "Einen Lauf starten" in content
    assert "Ausgewählte Läufe abbrechen" in content
    assert SCRIPT not in content


def test_messages_are_german(german_client: Client) -> None:
    run = durable_agents.start_run("tester", "Stop me")
    response = german_client.post(run_url(run).replace("/change/", "/cancel/"), follow=True)
    assert response.status_code == 200
    assert f"Lauf {run.pk} abgebrochen." in messages_of(response)
    response = german_client.post(
        runs_url(),
        {"action": "cancel_runs", "_selected_action": [str(run.pk)], "post": "yes"},
        follow=True,
    )
    assert "0 Läufe abgebrochen; 1 übersprungen" in " ".join(messages_of(response))


def test_mails_are_written_in_the_project_language(
    settings: Any, superuser: Any, mailoutbox: list[Any]
) -> None:
    settings.LANGUAGE_CODE = "de"
    run = durable_agents.start_run("tester", "Die")
    # A request in another language is being served: the mail is still the project's.
    with translation.override("en"):
        notifications.on_run_dead_lettered(None, run_id=run.pk, reason=SCRIPT)
    [mail] = mailoutbox
    assert mail.subject == f"[durable_agents] Lauf {run.pk} ist im Dead Letter"
    assert f"Grund: {SCRIPT}" in mail.body  # the reason is quoted as it is (a plain-text mail)
    assert "Reihen Sie ihn im Admin erneut ein" in mail.body


def test_english_is_unchanged_without_a_language(admin_client: Client) -> None:
    assert django_settings.LANGUAGE_CODE.startswith("en")
    content = page(admin_client, runs_url())
    assert "Start a run" in content
    assert "Cancel selected runs" in content
    assert views.compact_age(timezone.now() - datetime.timedelta(hours=3)) == "3h"


def test_the_schedules_list_and_panel_are_german_and_names_stay_escaped(
    german_client: Client,
) -> None:
    make("nightly")
    make("paused-one", enabled=False)
    make(f"orphan {SCRIPT}", agent="gone")
    content = page(german_client, list_url())

    for german in (
        "Wörter aus dem Namen des Zeitplans.",  # the search's help
        "Ausgewählte Zeitpläne pausieren",  # actions
        "Ausgewählte Zeitpläne fortsetzen",
        "Ausgewählte Zeitpläne jetzt ausführen",
        "Nach Zustand",  # a filter
        "Zeitsteuerung",  # column headers
        "Nächster Termin",
        "Letzter Lauf",
        "alle 5 min",  # the timing in words
        ">aktiv</span>",  # the states (ours, not django.contrib.auth's "Aktiv")
        ">pausiert</span>",
        ">defekt</span>",
        "kein Agent namens „gone“ ist registriert",  # why it is broken
    ):
        assert german in content, german
    for english in ("Pause selected schedules", "every 5 min", "Next slot", "no agent named"):
        assert english not in content, english
    assert SCRIPT not in content
    assert ESCAPED in content

    content = page(german_client, operations_url())
    for german in ("Zeitpläne", "Nächste Termine", "Handlungsbedarf", "Grund"):
        assert german in content, german
    assert "Next slots" not in content
    assert SCRIPT not in content


def test_an_unknown_intent_its_mail_a_keys_limit_and_a_short_id_are_german(
    german_client: Client,
    settings: Any,
    superuser: Any,
    mailoutbox: list[Any],
    da_settings: Any,
) -> None:
    from django.urls import reverse

    from durable_agents.models import IntentStatus, ToolIntent
    from tests.integration.test_admin import parked_intent

    # The intent page: why its outcome is unknown, as the worker recorded it, escaped.
    intent = parked_intent(IntentStatus.UNKNOWN)
    ToolIntent.objects.filter(pk=intent.pk).update(reason=SCRIPT)
    content = page(
        german_client, reverse("admin:durable_agents_toolintent_change", args=[intent.pk])
    )
    assert "Niemand weiß, ob er gewirkt hat" in content
    assert f"Was geschah: {ESCAPED}" in content
    assert SCRIPT not in content
    # Its mail, in the project's language; the recorded cause is quoted as it is.
    settings.LANGUAGE_CODE = "de"
    intent.refresh_from_db()
    notifications.on_intent_waiting(ToolIntent, intent)
    [mail] = mailoutbox
    assert "Ausgang unbekannt" in mail.subject
    assert f"Was geschah: {SCRIPT}" in mail.body
    assert f"klären Sie dann Intent {intent.pk} im Admin" in mail.body
    assert "Die Admin-Seite des Intents:" in mail.body
    # A key's page: its limit in force and where it comes from; the budget's label.
    da_settings(CONCURRENCY_LIMITS={"tenant:acme": 5})
    durable_agents.start_run("tester", "Hallo.", concurrency_key="tenant:acme")
    key_page = page(
        german_client, reverse("admin:durable_agents_concurrencykey_change", args=["tenant:acme"])
    )
    assert "Geltendes Limit" in key_page
    assert "5, aus der Einstellung CONCURRENCY_LIMITS" in key_page
    assert "USD pro Tag" in key_page
    # A short id that names no run, or several; the first characters of an id that name none.
    missing = german_client.get("/admin/durable_agents/agentrun/0123abcd/change/")
    assert missing.status_code == 404
    content = missing.content.decode()
    assert "Kein Lauf hat die Kurz-ID 0123abcd oder eine ID, die damit beginnt." in content
    assert "Lauf 0123abcd" in content
    assert "In der Liste der Läufe danach suchen" in content
    for digit in "12":  # two random ids that start alike
        run_id = f"abcd1234-{digit}000-4000-8000-000000000000"
        AgentRun.objects.create(id=run_id, agent="a", prompt_version="v", model="m", task="t")
    several = german_client.get("/admin/durable_agents/agentrun/abcd1234/change/")
    content = several.content.decode()
    assert "Mehrere Läufe haben die Kurz-ID abcd1234 oder eine ID, die damit beginnt" in content
    assert "Die Liste dieser Läufe" in content
    missing = german_client.get("/admin/durable_agents/agentrun/0123a/change/")
    assert "Die ID keines Laufs beginnt mit 0123a." in missing.content.decode()
