"""The message list, rebuilt from the step log exactly as it was sent before.

Payloads are parsed with plain ``json.loads``: Python dicts keep the order of the text, and the
SDK sends plain dicts as they are, so the rebuilt request body equals the original one (thinking
signatures bind values *and* key order). Nothing here normalises, strips or merges anything.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any, NamedTuple

from durable_agents.models import AgentStep, StepKind


def message_for_step(kind: str, payload: str) -> dict[str, Any]:
    return message_for(kind, json.loads(payload))


def message_for(kind: str, data: Any) -> dict[str, Any]:
    """The message a step contributes, from its parsed payload."""
    if kind == StepKind.MODEL_TURN:
        # The provider's whole response body is stored; only its content is sent back.
        return {"role": "assistant", "content": data["content"]}
    return {"role": "user", "content": data}


def messages_from_steps(steps: Iterable[tuple[str, str]]) -> list[dict[str, Any]]:
    """``steps``: (kind, payload) pairs in seq order, starting with the task."""
    return [message_for_step(kind, payload) for kind, payload in steps]


class StepRow(NamedTuple):
    seq: int
    kind: str
    payload: str


def load_steps(run_id: Any, after_seq: int = -1) -> list[StepRow]:
    """The log of a run from ``after_seq`` on, as plain rows (no model instances: a resume of a
    long run reads thousands of them)."""
    rows = (
        AgentStep.objects.filter(run_id=run_id, seq__gt=after_seq)
        .order_by("seq")
        .values_list("seq", "kind", "payload")
    )
    return [StepRow(*row) for row in rows]


def rebuild_messages(run_id: Any) -> list[dict[str, Any]]:
    return messages_from_steps((s.kind, s.payload) for s in load_steps(run_id))
