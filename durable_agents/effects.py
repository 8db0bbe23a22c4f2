"""Idempotency keys, the tool_effect ledger and the transitions of tool intents.

A key is derived from the call's *position* in the run (run id, seq of the model turn, index
of the call in that turn), the tool and its canonical arguments: two attempts at the same call
get the same key, any other call gets another one.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from django.db import transaction
from django.db.models.functions import Now

from durable_agents.models import IntentStatus, ToolEffect, ToolIntent


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def idempotency_key(run_id: Any, seq: int, call_index: int, tool: str, arguments: Any) -> str:
    material = f"{run_id}:{seq}:{call_index}:{tool}:{canonical_json(arguments)}"
    return hashlib.sha256(material.encode("utf-8", "surrogatepass")).hexdigest()


def _sanitize(text: str) -> str:
    # Lone surrogates cannot be encoded as UTF-8 (neither by the database nor the SDK).
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "surrogatepass").decode("utf-8", "replace")
    return text


def format_result(value: Any) -> tuple[str, bool]:
    """A tool's return value as tool_result text: (text, is_error)."""
    if not isinstance(value, str):
        try:
            value = json.dumps(value, ensure_ascii=False)
        except (TypeError, ValueError) as exc:
            return f"the tool returned a value that is not JSON-serialisable: {exc}", True
    return _sanitize(value), False


def error_text(message: str) -> tuple[str, bool]:
    """An error result for the model (exception messages may carry any text)."""
    return _sanitize(message), True


def recorded_effects(run_id: Any, seq: int) -> dict[str, ToolEffect]:
    """The calls of one turn that already completed, by key (one query per turn)."""
    return {e.key: e for e in ToolEffect.objects.filter(run_id=run_id, seq=seq)}


def record_effect(effect: ToolEffect) -> None:
    """Commit one completed call. A second recording of the same key changes nothing."""
    ToolEffect.objects.bulk_create([effect], ignore_conflicts=True)


def intent_for_key(key: str) -> ToolIntent | None:
    return ToolIntent.objects.filter(key=key).first()


def mark_intent_executing(intent: ToolIntent) -> bool:
    """approved -> executing, committed before the tool runs: after a crash, an ``executing``
    intent without an effect is how we know the outcome is unknown."""
    changed = ToolIntent.objects.filter(pk=intent.pk, status=IntentStatus.APPROVED).update(
        status=IntentStatus.EXECUTING, updated_at=Now()
    )
    if changed:
        intent.status = IntentStatus.EXECUTING
    return bool(changed)


def complete_intent(intent: ToolIntent, effect: ToolEffect) -> None:
    """Record the effect and mark the intent done, in one transaction."""
    with transaction.atomic():
        record_effect(effect)
        ToolIntent.objects.filter(pk=intent.pk).update(status=IntentStatus.DONE, updated_at=Now())
    intent.status = IntentStatus.DONE


def mark_intent_unknown(intent: ToolIntent) -> None:
    ToolIntent.objects.filter(pk=intent.pk, status=IntentStatus.EXECUTING).update(
        status=IntentStatus.UNKNOWN, updated_at=Now()
    )
    intent.status = IntentStatus.UNKNOWN
