"""Calls from services: ``Wait(callback=True)`` and the signed, single-use URL of the call,
through a real worker, the offline model over HTTP and the real view (Django's test client).
The tool (tests/testapp/wait_agents.py ``await_callback``) logs each invocation with its key
and ``woken_by``, and each URL it handed out, so each test sees exactly what the call got."""

from __future__ import annotations

import base64
import datetime
import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from django.db import connection
from django.db.models.functions import Now
from django.test import Client, override_settings
from django.urls import reverse

from durable_agents import api
from durable_agents.callbacks import callback_token
from durable_agents.models import AgentCallback, AgentRun, AgentStep, RunStatus, WaitKind
from tests.conftest import ROOT, database_url, run_worker
from tests.fakeserver import FakeAnthropic

pytestmark = pytest.mark.django_db(transaction=True)


def reload(run: AgentRun) -> AgentRun:
    return AgentRun.objects.get(pk=run.pk)


def start(arguments: dict[str, Any] | None = None) -> AgentRun:
    return api.start_run(
        "waiter", f"Wait for a service.\n@await_callback {json.dumps(arguments or {})}"
    )


def parked(arguments: dict[str, Any] | None = None) -> tuple[AgentRun, str]:
    """A run whose call waits on its callback, and the URL the call handed out."""
    run = start(arguments)
    run_worker()
    waiting = reload(run)
    assert (waiting.status, waiting.waiting_for) == (RunStatus.WAITING, WaitKind.CALLBACK)
    return waiting, handed_out()[-1]


def handed_out() -> list[str]:
    """The URLs the call gave the service, in order (each invocation gave its URL twice: both
    are checked equal here)."""
    from tests.testapp import receiver

    directory = os.environ["DA_RECEIVER_DIR"]
    urls = []
    for attempt in receiver.attempts(Path(directory)):
        if attempt["kind"] == "callback_url":
            assert attempt["payload"]["url"] == attempt["payload"]["again"]
            urls.append(attempt["payload"]["url"])
    return urls


def post(url: str, body: Any = None, *, raw: bytes | None = None, **extra: Any) -> Any:
    data = raw if raw is not None else json.dumps(body).encode()
    return Client().post(path(url), data, content_type="application/json", **extra)


def path(url: str) -> str:
    return urlsplit(url).path


def tool_result(run: AgentRun) -> Any:
    step = AgentStep.objects.get(run_id=run.pk, kind="tool_result")
    (block,) = json.loads(step.payload)
    return block


def time_passes(run: AgentRun) -> None:
    AgentRun.objects.filter(pk=run.pk).update(wake_at=Now() - datetime.timedelta(seconds=1))


def test_a_post_resumes_the_waiting_call_once_with_the_body(
    fake_api: FakeAnthropic, receiver: Any
) -> None:
    run, url = parked()
    assert url.startswith("http://testserver/agents/callbacks/")  # SITE_URL + the path
    assert run.lease_owner is None
    assert not AgentCallback.objects.exists()

    first = post(url, {"payment": "p-1", "status": "paid", "amount": 12.5})
    assert first.status_code == 200
    assert first.json() == {"status": "resumed"}
    assert reload(run).status == RunStatus.PENDING

    second = post(url, {"payment": "p-1", "status": "refunded"})
    assert second.status_code == 409
    run_worker()
    done = reload(run)
    assert done.status == RunStatus.SUCCEEDED, done.error
    calls = receiver.calls("await_callback")
    assert [c["woken_by"] is None for c in calls] == [True, False]
    assert calls[0]["key"] == calls[1]["key"]
    woken_by = calls[1]["woken_by"]
    assert woken_by["callback"] == {"payment": "p-1", "status": "paid", "amount": 12.5}
    assert datetime.datetime.fromisoformat(woken_by["at"]).tzinfo is not None
    assert json.loads(tool_result(done)["content"])["callback"]["status"] == "paid"
    # The run keeps only when it came; the body is stored once, with the callback.
    assert "callback" not in done.woken_by
    assert post(url, {"late": True}).status_code == 409  # the run is over


def test_a_post_before_the_park_is_kept_and_the_call_goes_on_with_it(
    fake_api: FakeAnthropic, receiver: Any
) -> None:
    run = start({"answer_first": {"status": "instant"}})
    run_worker()
    done = reload(run)
    assert done.status == RunStatus.SUCCEEDED, done.error
    assert done.waiting_for == ""  # never parked
    woken = [c["woken_by"] for c in receiver.calls("await_callback")]
    assert woken[0] is None
    assert woken[1]["callback"] == {"status": "instant"}
    assert post(handed_out()[0], {"status": "again"}).status_code == 409


def test_a_post_to_a_call_that_has_not_parked_is_accepted_and_kept(
    fake_api: FakeAnthropic, receiver: Any
) -> None:
    run = start()
    AgentRun.objects.filter(pk=run.pk).update(status=RunStatus.RUNNING)  # its call is running
    key = "ab" * 32
    answer = post(f"/agents/callbacks/{callback_token(run.pk, key)}", {"n": 2})
    assert answer.status_code == 202
    assert answer.json() == {"status": "accepted"}
    assert AgentCallback.objects.get(key=key).body == {"n": 2}
    assert reload(run).status == RunStatus.RUNNING  # nothing to wake
    assert post(f"/agents/callbacks/{callback_token(run.pk, key)}", {"n": 3}).status_code == 409


def test_a_signed_url_of_a_run_that_is_gone_is_over(fake_api: FakeAnthropic) -> None:
    run = start()
    token = callback_token(run.pk, "cd" * 32)
    AgentRun.objects.filter(pk=run.pk).delete()
    assert post(f"/agents/callbacks/{token}", {"n": 1}).status_code == 409


def test_forged_and_foreign_tokens_are_refused_and_change_nothing(
    fake_api: FakeAnthropic, receiver: Any
) -> None:
    run, url = parked()
    other, other_url = parked()
    token = path(url).rsplit("/", 1)[1]
    value, signature = token.rsplit(":", 1)
    run_part, key = value.split(".")
    other_key = path(other_url).rsplit("/", 1)[1].rsplit(":", 1)[0].split(".")[1]
    forged = [
        f"{value}:{'A' * len(signature)}",  # a made-up signature
        f"{run_part}.{other_key}:{signature}",  # this run's signature on the other's call
        f"{other.pk}.{key}:{signature}",  # the other run with this call
        "not-a-token",
        callback_token(run.pk, key).replace(str(run.pk)[:8], "00000000"),
    ]
    for token in forged:
        answer = post(f"/agents/callbacks/{token}", {"status": "paid"})
        assert answer.status_code == 403, token
    # Signed with another secret: forged too.
    with override_settings(SECRET_KEY="another-key-" + "x" * 50):
        made_elsewhere = callback_token(run.pk, key)
    assert post(f"/agents/callbacks/{made_elsewhere}", {"x": 1}).status_code == 403
    assert reload(run).status == RunStatus.WAITING
    assert reload(other).status == RunStatus.WAITING
    assert not AgentCallback.objects.exists()
    # The URL of the other run is that run's own: it resumes that run only.
    assert post(other_url, {"ok": True}).status_code == 200
    assert reload(run).status == RunStatus.WAITING
    assert reload(other).status == RunStatus.PENDING


def test_secret_key_fallbacks_keep_outstanding_urls_valid(
    fake_api: FakeAnthropic, receiver: Any
) -> None:
    from django.conf import settings

    run, url = parked()
    rotated = {"SECRET_KEY": "rotated-" + "y" * 50, "SECRET_KEY_FALLBACKS": [settings.SECRET_KEY]}
    with override_settings(**rotated):
        assert post(url, {"after": "rotation"}).status_code == 200
    assert reload(run).status == RunStatus.PENDING


def test_bad_bodies_and_methods_are_refused_and_change_nothing(
    fake_api: FakeAnthropic, receiver: Any, da_settings: Any
) -> None:
    run, url = parked()
    client = Client()
    assert client.get(path(url)).status_code == 405
    assert client.put(path(url), b"{}", content_type="application/json").status_code == 405
    assert post(url, raw=b"not json").status_code == 400
    assert post(url, raw=b"").status_code == 400
    assert post(url, raw=b"\xff\xfe{}").status_code == 400  # not UTF-8
    assert post(url, raw=b'{"x": NaN}').status_code == 400
    assert post(url, raw=b'{"x": "a\\u0000b"}').status_code == 400  # NUL
    assert post(url, raw=b'{"x": "\\ud800"}').status_code == 400  # a lone surrogate
    assert post(url, raw=b"[" * 200 + b"]" * 200).status_code == 400  # too deep
    assert post(url, raw=b"[" * 5000 + b"]" * 5000).status_code == 400  # deeper than json's
    da_settings(CALLBACK_MAX_BYTES=100)
    too_large = post(url, {"blob": "x" * 200})
    assert too_large.status_code == 413
    assert "CALLBACK_MAX_BYTES" in too_large.json()["error"]
    assert reload(run).status == RunStatus.WAITING
    assert not AgentCallback.objects.exists()
    assert post(url, {"blob": "x" * 50}).status_code == 200  # within the limit
    assert reload(run).status == RunStatus.PENDING
    assert AgentCallback.objects.get().body == {"blob": "x" * 50}


def test_a_body_larger_than_djangos_upload_limit_is_taken_up_to_callback_max_bytes(
    fake_api: FakeAnthropic, receiver: Any
) -> None:
    _, url = parked()
    body = {"blob": "x" * 5000}
    with override_settings(DATA_UPLOAD_MAX_MEMORY_SIZE=1000):
        assert post(url, body).status_code == 200
    run_worker()
    assert receiver.calls("await_callback")[-1]["woken_by"]["callback"] == body


def test_the_wait_times_out(fake_api: FakeAnthropic, receiver: Any) -> None:
    run, url = parked({"timeout": 3600})
    assert run.wake_at is not None
    assert run.waiting_since is not None
    assert 3599 <= (run.wake_at - run.waiting_since).total_seconds() <= 3601
    time_passes(run)
    run_worker()
    done = reload(run)
    assert done.status == RunStatus.SUCCEEDED, done.error
    assert [c["woken_by"] for c in receiver.calls("await_callback")] == [None, {"timeout": True}]
    late = post(url, {"status": "late"})
    assert late.status_code == 409  # the wait is over
    assert not AgentCallback.objects.exists()


def test_a_call_that_waits_again_after_a_timeout_keeps_its_url(
    fake_api: FakeAnthropic, receiver: Any
) -> None:
    run, url = parked({"timeout": 3600, "patient": True})
    time_passes(run)
    run_worker()  # woken by the timeout, the call waits again: invoked anew, the same URL
    again = reload(run)
    assert (again.status, again.waiting_for) == (RunStatus.WAITING, WaitKind.CALLBACK)
    assert handed_out() == [url, url]
    assert post(url, {"status": "paid"}).status_code == 200
    run_worker()
    assert reload(run).status == RunStatus.SUCCEEDED
    woken = [c["woken_by"] for c in receiver.calls("await_callback")]
    assert woken[:2] == [None, {"timeout": True}]
    assert woken[2]["callback"] == {"status": "paid"}


def test_a_second_wait_on_a_used_callback_is_a_tool_error(
    fake_api: FakeAnthropic, receiver: Any
) -> None:
    run, url = parked({"again": True})
    assert post(url, {"n": 1}).status_code == 200
    run_worker()
    done = reload(run)
    assert done.status == RunStatus.SUCCEEDED, done.error
    block = tool_result(done)
    assert block["is_error"] is True
    assert "received its callback already" in block["content"]
    assert len(receiver.calls("await_callback")) == 2  # no loop


def test_the_url_is_the_calls_own_in_any_process(fake_api: FakeAnthropic, receiver: Any) -> None:
    run, url = parked()
    key = receiver.calls("await_callback")[0]["key"]
    script = (
        "import django; django.setup()\n"
        "from durable_agents import callback_url\n"
        "from durable_agents.declare.waits import CallContext, calling\n"
        f"with calling(CallContext({str(run.pk)!r}, 0, {key!r})):\n"
        "    print(callback_url())\n"
    )
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "DATABASE_URL": database_url(),
        "PYTHONPATH": str(ROOT),
    }
    printed = subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert printed == url


def test_callback_url_outside_tool_code_is_refused() -> None:
    from durable_agents import callback_url

    with pytest.raises(RuntimeError, match="tool code"):
        callback_url()


def test_cancel_ends_the_wait_and_the_url_with_it(fake_api: FakeAnthropic, receiver: Any) -> None:
    run, url = parked()
    assert api.cancel_run(run.pk)
    assert post(url, {"status": "paid"}).status_code == 409
    assert reload(run).status == RunStatus.CANCELLED
    assert not AgentCallback.objects.exists()


def test_no_log_line_holds_the_token(
    fake_api: FakeAnthropic, receiver: Any, caplog: pytest.LogCaptureFixture
) -> None:
    _, url = parked()
    token = path(url).rsplit("/", 1)[1]
    with caplog.at_level(logging.DEBUG):
        assert post(url, raw=b"not json").status_code == 400
        assert Client().get(path(url)).status_code == 405
        assert post(url, {"ok": True}).status_code == 200
        assert post(url, {"ok": True}).status_code == 409
    assert caplog.records  # the view says what it did
    assert not [r for r in caplog.records if token in r.getMessage() or token in str(r.args)]


def test_the_body_is_encrypted_at_rest(
    fake_api: FakeAnthropic, receiver: Any, da_settings: Any
) -> None:
    da_settings(ENCRYPTION_KEYS=[base64.urlsafe_b64encode(b"A" * 32).decode()])
    run, url = parked()
    assert post(url, {"card": "okapi-4242"}).status_code == 200
    with connection.cursor() as cursor:
        cursor.execute("SELECT body FROM agent_callback")
        (stored,) = cursor.fetchone()
    assert "okapi" not in stored
    run_worker()
    assert reload(run).status == RunStatus.SUCCEEDED
    assert receiver.calls("await_callback")[-1]["woken_by"]["callback"] == {"card": "okapi-4242"}


def test_the_admin_shows_a_run_waiting_on_a_callback(
    fake_api: FakeAnthropic, receiver: Any, admin_client: Any
) -> None:
    run, url = parked()
    page = admin_client.get(reverse("admin:durable_agents_agentrun_change", args=[run.pk]))
    assert page.status_code == 200
    html = page.content.decode()
    assert "a callback" in html
    assert path(url).rsplit("/", 1)[1] not in html  # the URL is the call's secret
