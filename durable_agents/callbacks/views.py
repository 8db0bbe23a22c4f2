"""``callbacks/<token>``: a service's POST that completes a call's ``Wait(callback=True)``.

    403  the token is forged or altered (always, whether or not its run exists)
    405  not a POST
    413  the body is larger than CALLBACK_MAX_BYTES
    400  the body is not JSON (UTF-8, no NaN, no NUL or lone surrogates, not too deep)
    409  the URL was used already, or the wait is over (the call returned, the run finished)
    200  {"status": "resumed"}: the run waited on it and is resumed with the body
    202  {"status": "accepted"}: the call has not parked on it yet; it goes on with the body
         when it does

The signature is the authentication (services POST without a CSRF token or a session), and it
is checked before anything else: a forged request costs one HMAC, no body read and no query.
The body is read by this view up to CALLBACK_MAX_BYTES + 1 bytes, never more, so Django's
DATA_UPLOAD_MAX_MEMORY_SIZE does not apply to it. Nothing is changed by a refused request.
No log line holds the token (``durable_agents.callbacks`` names the run and the call; the
answers are kept out of ``django.request``'s log); a web server's access log would hold it.
"""

from __future__ import annotations

import logging

from django.http import HttpRequest, HttpResponseNotAllowed, JsonResponse
from django.http.response import HttpResponseBase
from django.views.decorators.csrf import csrf_exempt

from durable_agents.callbacks import BadBody, callback_target, parse_body
from durable_agents.conf import app_settings
from durable_agents.store import current
from durable_agents.store.base import CallbackReceipt

logger = logging.getLogger("durable_agents.callbacks")

_ANSWERS: dict[CallbackReceipt, tuple[int, dict[str, str]]] = {
    CallbackReceipt.WOKEN: (200, {"status": "resumed"}),
    CallbackReceipt.KEPT: (202, {"status": "accepted"}),
    CallbackReceipt.USED: (409, {"error": "this callback URL was used already"}),
    CallbackReceipt.OVER: (409, {"error": "the wait this callback URL completes is over"}),
}


@csrf_exempt
def receive(request: HttpRequest, token: str) -> HttpResponseBase:
    response = _answer(request, token)
    # The URL holds the token, which is as good as a password while the wait lasts: Django
    # would log the path of every 4xx answer (django.request), so this view's answers are
    # marked logged, and its own line names the run and the call instead.
    response._has_been_logged = True  # type: ignore[attr-defined]
    return response


def _answer(request: HttpRequest, token: str) -> HttpResponseBase:
    if request.method != "POST":
        return HttpResponseNotAllowed(["POST"])
    target = callback_target(token)
    if target is None:
        # DEBUG: anyone can send these, and a flood of them must not flood the logs.
        logger.debug("callback refused: a forged or altered URL")
        return JsonResponse({"error": "invalid callback URL"}, status=403)
    run_id, key = target
    limit = int(app_settings.CALLBACK_MAX_BYTES)
    try:
        declared = int(request.META.get("CONTENT_LENGTH") or 0)
    except ValueError:
        return JsonResponse({"error": "invalid Content-Length"}, status=400)
    try:
        if declared > limit:  # refused before a byte is read
            raise BadBody(413, f"the body is at most {limit} bytes (CALLBACK_MAX_BYTES)")
        body = parse_body(request.read(limit + 1), limit)
    except BadBody as bad:
        logger.info("run %s: callback of call %s refused (%s)", run_id, key[:12], bad.status)
        return JsonResponse({"error": bad.reason}, status=bad.status)
    receipt = current().receive_callback(run_id, key, body)
    logger.info("run %s: callback of call %s %s", run_id, key[:12], receipt.value)
    status, answer = _ANSWERS[receipt]
    return JsonResponse(answer, status=status)
