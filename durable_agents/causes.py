"""The cause of a dead run: its reason with the variable parts folded away.

A run is dead-lettered with a reason, and the reason usually carries what only that run had:
the provider's request id, a run or tool-call id, a timestamp, a count. The dead letter groups
runs by cause, so ``dead_cause`` replaces those parts with placeholders, and the store writes
the result into ``agent_run.dead_cause`` when the run is dead-lettered (``store.base.ended``):
the dead-letter page then groups with an index instead of reading every reason.
"""

from __future__ import annotations

import re
from typing import Any

from durable_agents._internal.text import storable_text

# agent_run.dead_cause is a CharField of this length (an indexed column): longer causes are
# cut, and two causes that agree on their first MAX_CAUSE_CHARS characters are one group.
MAX_CAUSE_CHARS = 255

# Variable parts of an error, replaced by placeholders so that two runs that died of the same
# cause share one group. Order matters: ids before hex, hex before plain numbers.
_CAUSE_RULES: tuple[tuple[re.Pattern[str], str], ...] = (
    # "request id req_011CX...", "request-id: 7f3a...": whatever follows the label.
    (re.compile(r"(request[ _-]?id\b[\s:=]*)[^\s,;)\]}'\"]+", re.IGNORECASE), r"\1<id>"),
    # Provider ids: req_..., msg_..., toolu_..., srvtoolu_...
    (re.compile(r"\b(req|msg|toolu|srvtoolu|call|run|chatcmpl)_[A-Za-z0-9_-]+"), r"\1_<id>"),
    (
        re.compile(
            r"\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b", re.IGNORECASE
        ),
        "<uuid>",
    ),
    (
        re.compile(
            r"\b\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}(?::\d{2}(?:\.\d+)?)?(?:Z|[+-]\d{2}:?\d{2})?\b"
        ),
        "<time>",
    ),
    # Hex ids and fingerprints: six or more hex digits with at least one digit and one letter
    # ("decade" stays a word, 200000 is a number for the rule below).
    (re.compile(r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{6,}\b", re.IGNORECASE), "<hex>"),
    # Numbers standing alone (counts, seqs, pids, durations); not those inside a name such as
    # claude-3-5 or v1. HTTP statuses are kept by _number below: they are causes of their own.
    (
        re.compile(r"(?<![\w.<-])(\(?)(\d+(?:\.\d+)?)(ms|s|KB|MB|GB)?(\)?)(?![\w.>])"),
        "",
    ),
    (re.compile(r"\s+"), " "),
)


_HTTP_STATUS_BEFORE = re.compile(r"(?:HTTP|status|code)[\s:=]*$", re.IGNORECASE)


def _number(match: re.Match[str]) -> str:
    opening, number, unit, closing = match.groups()
    before = match.string[: match.start()]
    is_status = len(number) == 3 and number[0] in "12345" and not unit
    if is_status and ((opening and closing) or _HTTP_STATUS_BEFORE.search(before[-12:])):
        return match.group()
    return f"{opening}<n>{closing}"


def dead_cause(reason: str) -> str:
    """The cause of a dead run: its reason with the variable parts (request ids, UUIDs, hex
    ids, timestamps, numbers) replaced by placeholders, so that runs that died of the same
    cause group together on the dead-letter page."""
    cause = storable_text(reason).strip()
    for pattern, placeholder in _CAUSE_RULES:
        cause = pattern.sub(placeholder or _number, cause)
    return cause.strip()


def error_reason(error: str) -> str:
    """The first non-empty line of a run's error: what the dead letter groups on."""
    return next((line.strip() for line in (error or "").splitlines() if line.strip()), "")


def cause_of(error: str) -> str:
    """What ``agent_run.dead_cause`` stores for a run dead-lettered with ``error``."""
    return dead_cause(error_reason(error))[:MAX_CAUSE_CHARS]


def backfill_causes(model: Any, batch_size: int = 1000) -> int:
    """Set ``dead_cause`` on the dead runs that have none (runs dead-lettered before the
    column existed), ``batch_size`` runs per transaction, in primary-key order; how many.
    ``model`` is AgentRun, or its historical version in a migration."""
    from django.db import transaction
    from django.db.models.functions import Substr

    done = 0
    last = None
    while True:
        batch = model.objects.filter(status="dead", dead_cause="").order_by("pk")
        if last is not None:
            batch = batch.filter(pk__gt=last)
        rows = list(
            batch.annotate(head=Substr("error", 1, 2000)).values_list("pk", "head")[:batch_size]
        )
        if not rows:
            return done
        by_cause: dict[str, list[Any]] = {}
        for pk, head in rows:
            by_cause.setdefault(cause_of(head), []).append(pk)
        with transaction.atomic():
            for cause, pks in by_cause.items():
                model.objects.filter(pk__in=pks, status="dead").update(dead_cause=cause)
        done += len(rows)
        last = rows[-1][0]
