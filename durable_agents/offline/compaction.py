"""Server-side compaction and context editing in the offline model.

Long transcripts, as the real API documents them:

- Server-side compaction: ``context_management.edits`` with ``{"type": "compact_20260112",
  "trigger": {"type": "input_tokens", "value": N}, "pause_after_compaction": bool}`` and the
  ``compact-2026-01-12`` beta in the ``anthropic-beta`` header (without it: a 400). When the
  estimated input (``len(JSON) // 4`` of the messages the model reads, i.e. from the last
  compaction block on) reaches N, the answer starts with ``{"type": "compaction", "content":
  <summary>, "encrypted_content": <state>}``: the state is what the model needs to go on (the
  turns done, the task's script), signed like a thinking block, so a changed block is a 400.
  Then come the turn's usual blocks, or, with ``pause_after_compaction``, nothing more and
  ``stop_reason: "compaction"`` (the next request ends with that turn; the answer continues
  it). ``usage.iterations`` lists the compaction pass and the message pass; the top-level
  ``usage`` is the message pass alone. The real API wants N >= 50,000; this model takes any
  N >= ``OFFLINE_MIN_COMPACTION_TRIGGER`` (100) so tests compact after a few turns.
- Reading a request, everything before the last compaction block is dropped, as the API does:
  the script and turn count come from that block's state, the input tokens billed count only
  what follows it, and thinking signatures are checked from it on (a thinking block after the
  compaction block in the same turn is signed over that block alone). A compaction block
  whose content is null (a failed compaction) is a no-op.
- Context editing (beta ``context-management-2025-06-27``; ``clear_tool_uses_20250919``,
  ``clear_thinking_20251015``): validated (beta, types, clear_thinking first) but not applied.
- Automatic prompt caching: a top-level ``cache_control`` (``{"type": "ephemeral"}``, ``ttl``
  optional) is accepted. The model stays a pure function of the request, so it assumes the
  conversation's previous call was made within the cache's lifetime: the input up to the last
  two messages (the previous request) is billed as ``cache_read_input_tokens``, the rest as
  ``cache_creation_input_tokens``; a conversation's first call (and the first after a
  compaction) reads nothing from the cache.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from typing import Any, NamedTuple

from durable_agents._internal.deepjson import loads_deep
from durable_agents.offline.script import Script
from durable_agents.offline.signatures import canonical_bytes
from durable_agents.offline.wire import blocks_of, invalid, text_of

COMPACT_EDIT = "compact_20260112"
COMPACT_BETA = "compact-2026-01-12"
CONTEXT_EDITING_BETA = "context-management-2025-06-27"
CLEAR_TOOL_USES_EDIT = "clear_tool_uses_20250919"
CLEAR_THINKING_EDIT = "clear_thinking_20251015"
DEFAULT_COMPACTION_TRIGGER = 150_000
# The real API refuses triggers below 50,000 input tokens; the offline model takes small ones
# so that a test compacts after a few turns.
API_MIN_COMPACTION_TRIGGER = 50_000
OFFLINE_MIN_COMPACTION_TRIGGER = 100
COMPACTION_ERROR = "Invalid compaction block"


class CompactionEdit(NamedTuple):
    """The request's compaction edit."""

    trigger: int
    pause: bool
    instructions: str | None


class View(NamedTuple):
    """What the model reads of a request's messages: from the last compaction block on."""

    messages: list[dict[str, Any]]  # the first one starts at the compaction block when cut
    cut: tuple[int, int] | None  # (message, block) of the last compaction block
    dropped: list[dict[str, Any]]  # messages before it (their bytes are not billed)
    turns_before: int  # turns done before the compaction block (its state), else 0
    task: str  # the script: the first message's text, or the compaction state's


def compaction_edit(value: Any, betas: frozenset[str]) -> CompactionEdit | None:
    """The compaction edit of ``context_management`` (None without one), after checking every
    edit as the API does."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise invalid("context_management: must be an object")
    edits = value.get("edits", [])
    if not isinstance(edits, list):
        raise invalid("context_management.edits: must be a list")
    found: CompactionEdit | None = None
    for k, edit in enumerate(edits):
        where = f"context_management.edits.{k}"
        if not isinstance(edit, dict) or not isinstance(edit.get("type"), str):
            raise invalid(f"{where}: must be an object with a `type`")
        kind = edit["type"]
        if kind == COMPACT_EDIT:
            if COMPACT_BETA not in betas:
                raise invalid(
                    f"{where}: `{COMPACT_EDIT}` needs the anthropic-beta header {COMPACT_BETA!r}"
                )
            if found is not None:
                raise invalid(f"{where}: only one `{COMPACT_EDIT}` edit is allowed")
            found = _compaction_config(edit, where)
        elif kind in (CLEAR_TOOL_USES_EDIT, CLEAR_THINKING_EDIT):
            if CONTEXT_EDITING_BETA not in betas:
                raise invalid(
                    f"{where}: `{kind}` needs the anthropic-beta header {CONTEXT_EDITING_BETA!r}"
                )
            if kind == CLEAR_THINKING_EDIT and k != 0:
                raise invalid(f"{where}: `{CLEAR_THINKING_EDIT}` must be the first edit")
        else:
            raise invalid(f"{where}.type: unknown context management edit {kind!r}")
    return found


def _compaction_config(edit: dict[str, Any], where: str) -> CompactionEdit:
    trigger = edit.get("trigger")
    value = DEFAULT_COMPACTION_TRIGGER
    if trigger is not None:
        given = trigger.get("value") if isinstance(trigger, dict) else None
        if (
            not isinstance(trigger, dict)
            or trigger.get("type") != "input_tokens"
            or not isinstance(given, int)
            or isinstance(given, bool)
        ):
            raise invalid(f'{where}.trigger: must be {{"type": "input_tokens", "value": <int>}}')
        value = given
        if value < OFFLINE_MIN_COMPACTION_TRIGGER:
            raise invalid(
                f"{where}.trigger.value: must be at least {OFFLINE_MIN_COMPACTION_TRIGGER} "
                f"offline (the API wants at least {API_MIN_COMPACTION_TRIGGER})"
            )
    pause = edit.get("pause_after_compaction", False)
    if not isinstance(pause, bool):
        raise invalid(f"{where}.pause_after_compaction: must be a boolean")
    instructions = edit.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise invalid(f"{where}.instructions: must be a string or null")
    return CompactionEdit(value, pause, instructions)


def view_of(
    secret: bytes, model: str, messages: list[dict[str, Any]], betas: frozenset[str]
) -> View:
    """Drop every message block before the last compaction block, as the API does; the
    block's state must be the one this model signed (else a 400)."""
    cut: tuple[int, int] | None = None
    for i, m in enumerate(messages):
        for j, b in enumerate(blocks_of(m["content"])):
            if b["type"] != "compaction":
                continue
            if COMPACT_BETA not in betas:
                raise invalid(
                    f"messages.{i}.content.{j}: compaction blocks need the anthropic-beta "
                    f"header {COMPACT_BETA!r}"
                )
            if m["role"] != "assistant":
                raise invalid(f"messages.{i}.content.{j}: compaction blocks are the model's")
            if b.get("content") is not None:
                cut = (i, j)
    if cut is None:
        return View(messages, None, [], 0, text_of(messages[0]["content"]))
    i, j = cut
    block = messages[i]["content"][j]
    turns, task = _state(secret, model, block, f"messages.{i}.content.{j}")
    first = {**messages[i], "content": messages[i]["content"][j:]}
    dropped = messages[:i]
    if j:
        dropped = [*dropped, {**messages[i], "content": messages[i]["content"][:j]}]
    return View([first, *messages[i + 1 :]], cut, dropped, turns, task)


def _state(secret: bytes, model: str, block: dict[str, Any], where: str) -> tuple[int, str]:
    summary, encrypted = block.get("content"), block.get("encrypted_content")
    error = invalid(
        f"{where}: {COMPACTION_ERROR}: send compaction blocks back exactly as received, "
        "to the model that wrote them"
    )
    if not isinstance(encrypted, str) or encrypted.count(".") != 1:
        raise error
    state, mac = encrypted.split(".")
    if not hmac.compare_digest(mac, state_mac(secret, model, summary, state)):
        raise error
    decoded = loads_deep(base64.urlsafe_b64decode(state.encode("ascii")))
    return int(decoded["turns"]), str(decoded["task"])


def state_mac(secret: bytes, model: str, summary: Any, state: str) -> str:
    """The MAC that binds a compaction state to the model and the summary."""
    payload = canonical_bytes(["compaction", model, summary, state])
    digest = hmac.new(secret, payload, hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).decode("ascii").rstrip("=")


def compaction_block(
    secret: bytes, model: str, turn: int, view: View, script: Script, edit: CompactionEdit
) -> dict[str, Any]:
    """The summary of what the model read, and the state it goes on from (the turns done
    and the task), signed over the model and the summary."""
    summary = (
        f"Summary by the offline model: {turn} turn(s) of the task "
        f"{script.first_line!r} are done ({len(script.plan)} planned); the "
        f"{len(view.messages)} message(s) read so far are replaced by this summary."
    )
    if edit.instructions:
        summary += f" Instructions followed: {edit.instructions}"
    state = base64.urlsafe_b64encode(canonical_bytes({"turns": turn, "task": view.task})).decode(
        "ascii"
    )
    return {
        "type": "compaction",
        "content": summary,
        "encrypted_content": f"{state}.{state_mac(secret, model, summary, state)}",
    }
