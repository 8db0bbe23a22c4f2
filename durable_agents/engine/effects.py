"""Idempotency keys, tool results as text, and the tool_effect ledger and intents of a run
(read and written through the store: ``durable_agents.store``).

A key is derived from the call's *position* in the run (run id, seq of the model turn, index
of the call in that turn), the tool and its canonical arguments: two attempts at the same call
get the same key, any other call gets another one.
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import Any

from django.utils.module_loading import import_string

from durable_agents._internal.text import Unstorable, json_text, storable_text
from durable_agents.conf import app_settings
from durable_agents.models import AgentRun, ToolEffect, ToolIntent
from durable_agents.store import Store, current
from durable_agents.store.base import RunId

logger = logging.getLogger("durable_agents.effects")


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def idempotency_key(run_id: RunId, seq: int, call_index: int, tool: Any, arguments: Any) -> str:
    try:
        shown = canonical_json(arguments)
    except (TypeError, ValueError, RecursionError):
        # Input too deep (or otherwise unwritable) to canonicalise: it never reaches a tool
        # (validation refuses it), and the position alone already makes the key unique.
        shown = "<input that cannot be written as JSON>"
    material = f"{run_id}:{seq}:{call_index}:{tool}:{shown}"
    return hashlib.sha256(material.encode("utf-8", "surrogatepass")).hexdigest()


def key_run(run: AgentRun, seq: int) -> RunId:
    """The run whose id the keys of the calls of ``run``'s model turn ``seq`` are derived
    from: the run itself, but for a fork's fork-point turn the run it was forked from (or
    that run's own key run, for a fork of a fork at the same turn). Those calls may have been
    made by the original and not recorded (in flight, cut by a crash): with the original's
    keys, a receiver that deduplicates by key sees one call. Kept on the fork's row as a plain
    id, so the keys stay the same after the original is deleted."""
    if run.fork_key_run_id is not None and seq == run.fork_seq:
        return run.fork_key_run_id
    return run.pk


def format_result(value: Any) -> tuple[str, bool]:
    """A tool's return value as tool_result text: (text, is_error). Never raises: a value that
    cannot be written (too deep, not JSON) is an error result that says why."""
    if not isinstance(value, str):
        try:
            value = json_text(value)
        except Unstorable as exc:
            return f"the tool returned a value that {exc}", True
    return storable_text(value), False


def tool_error_text(tool_name: str, exc: BaseException) -> str:
    """What the model and the transcript are told when a tool raises: the TOOL_ERROR_FORMATTER
    setting's text (a project may redact secrets there), by default the type and message."""
    default = f"{tool_name} raised {type(exc).__name__}: {storable_text(exc, 2000)}"
    path = app_settings.TOOL_ERROR_FORMATTER
    if not path:
        return default
    try:
        formatter = path if callable(path) else import_string(path)
        return storable_text(formatter(tool_name, exc))
    except Exception:
        # A broken formatter must not break the run, nor leak what it was meant to hide.
        logger.exception("TOOL_ERROR_FORMATTER %r failed; only the error type is shown", path)
        return f"{tool_name} raised {type(exc).__name__}"


def recorded_effects(run_id: RunId, seq: int, store: Store | None = None) -> dict[str, ToolEffect]:
    """The calls of one turn that already completed, by key (one query per turn)."""
    return (store or current()).recorded_effects(run_id, seq)


def record_effect(effect: ToolEffect, store: Store | None = None) -> None:
    """Commit one completed call. A second recording of the same key changes nothing."""
    (store or current()).record_effect(effect)


def intent_for_key(key: str, store: Store | None = None) -> ToolIntent | None:
    return (store or current()).intent_for_key(key)


def complete_intent(intent: ToolIntent, effect: ToolEffect, store: Store | None = None) -> None:
    """The approved call ran: record its effect, mark the intent done and wake the run if it
    is parked, in one transaction (``Store.complete_intent``). Not fenced: the call happened
    whoever holds the run now."""
    (store or current()).complete_intent(intent, effect)
