"""What the read-only subcommands print: runs, one run with its transcript, intents, workers.

Each reads as the admin's pages read (inside ``encryption.shown()``: a value whose key is
gone reads as "[cannot decrypt: ...]" instead of failing the listing) and a bounded number of
rows: the runs list reads the head of each task, not the task; ``show`` reads the steps it
prints (and the one before, which names the tools whose results open them)."""

from __future__ import annotations

import datetime
import json
from decimal import Decimal
from typing import Any

from django.db.models import BooleanField, Case, F, TextField, Value, When
from django.db.models.functions import Now, Substr

from durable_agents._internal.deepjson import dumps_deep, loads_deep
from durable_agents.cli.formatting import (
    HEAD_CHARS,
    Output,
    decimal_text,
    iso,
    iso_exact,
    lines_of,
    one_line,
    table,
    usd,
)
from durable_agents.models import (
    AgentRun,
    AgentStep,
    AgentWorker,
    IntentStatus,
    RunStatus,
    StepKind,
    ToolIntent,
    short_id,
)
from durable_agents.models.forks import log_of
from durable_agents.models.trees import FamilyCost, family_costs

# Characters of a task the runs list reads (the JSON document's ``task_head``).
TASK_HEAD_CHARS = 200
# A block of a transcript longer than this is cut, with a note saying how long it was.
BLOCK_CHARS = 10_000
# Intents waiting for a person: listed first, oldest first (a queue).
AWAITING_PERSON = (IntentStatus.PENDING, IntentStatus.UNKNOWN)


# -- runs ----------------------------------------------------------------------------------------


def status_text(run: AgentRun) -> str:
    """``waiting: intent`` for a waiting run (what it waits for), else the status."""
    if run.status == RunStatus.WAITING and run.waiting_for:
        return f"{run.status}: {run.waiting_for}"
    return str(run.status)


def _family_fields(family: FamilyCost | None) -> dict[str, Any]:
    if family is None:
        return {}
    return {
        "cost_with_descendants_usd": decimal_text(family.cost),
        "descendants": family.descendants,
        "descendants_complete": family.complete,
    }


def run_document(run: AgentRun, family: FamilyCost | None = None) -> dict[str, Any]:
    """A run as the JSON document gives it (the runs list and ``show`` alike)."""
    return {
        "id": str(run.pk),
        "short_id": short_id(run.pk),
        "agent": run.agent,
        "version": run.prompt_version,
        "model": run.model,
        "status": run.status,
        "waiting_for": run.waiting_for or None,
        "created_at": iso_exact(run.created_at),
        "updated_at": iso_exact(run.updated_at),
        "attempts": run.attempt,
        "priority": run.priority,
        "parent_id": None if run.parent_id is None else str(run.parent_id),
        "concurrency_key": run.concurrency_key,
        "start_key": run.start_key,
        "metadata": run.metadata or {},
        "tokens_used": run.tokens_used,
        "cost_usd": decimal_text(run.cost_usd),
        **_family_fields(family),
    }


def list_runs(
    *,
    statuses: list[str],
    agent: str | None,
    key: str | None,
    metadata: dict[str, Any],
    since: datetime.datetime | None,
    limit: int,
) -> Output:
    """The newest runs that match, at most ``limit``."""
    runs = AgentRun.objects.all()
    if metadata:
        runs = runs.with_metadata(**metadata)
    if statuses:
        runs = runs.filter(status__in=statuses)
    if agent is not None:
        runs = runs.filter(agent=agent)
    if key is not None:
        runs = runs.filter(start_key=key)
    if since is not None:
        runs = runs.filter(created_at__gte=since)
    found = list(
        runs.annotate(task_head=Substr("task", 1, TASK_HEAD_CHARS, output_field=TextField()))
        .defer("task", "result", "error", "woken_by", "wait_runs", "trace_context")
        .order_by("-created_at", "-pk")[:limit]
    )
    families = family_costs(found)
    documents = []
    rows = []
    for run in found:
        head: str = run.task_head  # type: ignore[attr-defined]
        documents.append({**run_document(run, families[run.pk]), "task_head": head})
        rows.append(
            [
                short_id(run.pk),
                one_line(f"{run.agent}@{run.prompt_version}", 40),
                one_line(status_text(run)),
                iso(run.created_at),
                iso(run.updated_at),
                str(run.attempt),
                usd(run.cost_usd),
                one_line(head, HEAD_CHARS),
            ]
        )
    headers = ["ID", "AGENT", "STATUS", "CREATED", "UPDATED", "ATTEMPTS", "COST", "TASK"]
    lines = table(headers, rows) or ["No runs match."]
    return Output({"count": len(documents), "limit": limit, "runs": documents}, lines)


# -- one run and its transcript --------------------------------------------------------------


def _content_text(content: Any) -> str:
    """A task's or a tool result's content as text: a string as it is, text blocks joined,
    anything else as JSON."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(b, dict) and b.get("type") == "text" for b in content
    ):
        return "\n".join(str(b.get("text", "")) for b in content)
    return dumps_deep(content)


def _cut(text: str) -> str:
    if len(text) <= BLOCK_CHARS:
        return text
    return f"{text[:BLOCK_CHARS]}\n[cut: {len(text)} characters in all]"


def _blocks(step: AgentStep, data: Any, names: dict[str, str]) -> list[dict[str, Any]]:
    """The blocks of one step as the JSON document gives them; ``names`` maps tool_use ids to
    tool names (it learns a model turn's calls, to name the next step's results)."""
    if step.kind == StepKind.TASK:
        return [{"type": "text", "text": _content_text(data)}]
    if step.kind == StepKind.MODEL_TURN and isinstance(data, dict):
        content = data.get("content")
        blocks: list[dict[str, Any]] = []
        for block in content if isinstance(content, list) else []:
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text":
                blocks.append({"type": "text", "text": str(block.get("text", ""))})
            elif kind == "thinking":
                blocks.append({"type": "thinking", "chars": len(str(block.get("thinking", "")))})
            elif kind == "redacted_thinking":
                blocks.append({"type": "redacted_thinking"})
            elif kind == "tool_use":
                call_id, name = str(block.get("id", "")), str(block.get("name", ""))
                names[call_id] = name
                blocks.append(
                    {"type": "tool_use", "id": call_id, "name": name, "input": block.get("input")}
                )
            elif kind == "compaction":
                summary = block.get("content")
                text = None if summary is None else _content_text(summary)
                blocks.append({"type": "compaction", "summary": text})
            else:
                blocks.append({"type": "other", "json": dumps_deep(block)})
        return blocks
    if step.kind == StepKind.TOOL_RESULT and isinstance(data, list):
        results = []
        for block in data:
            if not isinstance(block, dict):
                results.append({"type": "other", "json": dumps_deep(block)})
                continue
            call_id = str(block.get("tool_use_id", ""))
            result: dict[str, Any] = {
                "type": "tool_result",
                "tool_use_id": call_id,
                "tool_name": names.get(call_id, ""),
                "is_error": bool(block.get("is_error")),
                "content": _content_text(block.get("content", "")),
            }
            results.append(result)
        return results
    if step.kind == StepKind.MESSAGE and isinstance(data, list):
        # What a user sent while the run worked (send_message): text blocks.
        return [
            {"type": "text", "text": str(block.get("text", ""))}
            if isinstance(block, dict) and block.get("type") == "text"
            else {"type": "other", "json": dumps_deep(block)}
            for block in data
        ]
    return [{"type": "other", "json": dumps_deep(data)}]


ROLES: dict[str, str] = {
    StepKind.TASK: "user",
    StepKind.MODEL_TURN: "assistant",
    StepKind.TOOL_RESULT: "user",
    StepKind.MESSAGE: "user",
}


def step_document(step: AgentStep, names: dict[str, str]) -> dict[str, Any]:
    try:
        data = loads_deep(step.payload)
    except ValueError:  # not JSON (or a value that cannot be decrypted, as its reason)
        blocks: list[dict[str, Any]] = [{"type": "unparsed", "text": str(step.payload)}]
    else:
        blocks = _blocks(step, data, names)
    return {
        "seq": step.seq,
        "kind": step.kind,
        "role": ROLES.get(step.kind, ""),
        "created_at": iso_exact(step.created_at),
        "blocks": blocks,
    }


def step_lines(step: dict[str, Any]) -> list[str]:
    """One step as text: a heading, then each block indented, every text escaped."""
    lines = [f"#{step['seq']} {step['kind']} ({step['role']}) {iso(_parse(step['created_at']))}"]
    for block in step["blocks"]:
        kind = block["type"]
        if kind == "text":
            lines += lines_of(_cut(block["text"]))
        elif kind == "thinking":
            lines.append(f"  [thinking, {block['chars']} chars]")
        elif kind == "redacted_thinking":
            lines.append("  [redacted thinking]")
        elif kind == "tool_use":
            call = json.dumps(block["input"], ensure_ascii=False)
            lines.append(f"  tool_use {one_line(block['name'], 200)} ({one_line(block['id'], 80)})")
            lines += lines_of(_cut(call), "    ")
        elif kind == "tool_result":
            error = " [error]" if block["is_error"] else ""
            name = one_line(block["tool_name"], 200) or "?"
            lines.append(f"  tool_result of {name} ({one_line(block['tool_use_id'], 80)}){error}")
            lines += lines_of(_cut(block["content"]), "    ")
        elif kind == "compaction":
            summary = block["summary"]
            lines.append("  [compaction]" if summary is not None else "  [compaction failed]")
            if summary is not None:
                lines += lines_of(_cut(summary), "    ")
        else:
            lines += lines_of(_cut(block.get("json") or block.get("text") or ""))
    return lines


def _parse(value: str | None) -> datetime.datetime | None:
    if value is None:
        return None
    return datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))


def show_run(run: AgentRun, *, steps: int | None) -> Output:
    """The run's header and its last ``steps`` steps (None: all of them), oldest first."""
    family = family_costs([run])[run.pk]
    log = log_of(run)
    total = log.count()
    newest = log.order_by("-seq")
    rows = list(newest if steps is None else newest[: steps + 1])
    before = rows[steps] if steps is not None and len(rows) > steps else None
    shown = list(reversed(rows[:steps] if steps is not None else rows))
    names: dict[str, str] = {}
    if before is not None and before.kind == StepKind.MODEL_TURN:
        step_document(before, names)  # for the names of its calls only
    documents = [step_document(step, names) for step in shown]
    run_doc = {
        **run_document(run, family),
        "started_at": iso_exact(run.started_at),
        "finished_at": iso_exact(run.finished_at),
        "forked_from": None if run.forked_from_id is None else str(run.forked_from_id),
        "fork_seq": run.fork_seq,
        "result": run.result,
        "error": run.error or None,
    }
    document = {"run": run_doc, "steps_total": total, "steps": documents}
    lines = header_lines(run, family)
    lines.append("")
    if len(documents) < total:
        lines.append(
            f"Steps: the last {len(documents)} of {total} (--steps N for more, --all for all)."
        )
    else:
        lines.append(f"Steps: {total}.")
    for step in documents:
        lines.append("")
        lines += step_lines(step)
    return Output(document, lines)


def header_lines(run: AgentRun, family: FamilyCost) -> list[str]:
    fields: list[tuple[str, str]] = [
        ("run", f"{run.pk} ({short_id(run.pk)})"),
        ("status", one_line(status_text(run))),
        ("agent", one_line(f"{run.agent}@{run.prompt_version}")),
        ("model", one_line(run.model)),
        ("created", iso(run.created_at)),
        ("updated", iso(run.updated_at)),
    ]
    if run.started_at:
        fields.append(("started", iso(run.started_at)))
    if run.finished_at:
        fields.append(("finished", iso(run.finished_at)))
    if run.status == RunStatus.WAITING and run.wake_at:
        fields.append(("wakes", iso(run.wake_at)))
    fields.append(("attempts", str(run.attempt)))
    if run.priority:
        fields.append(("priority", str(run.priority)))
    if run.parent_id:
        fields.append(("parent", f"{run.parent_id} ({short_id(run.parent_id)})"))
    if run.forked_from_id:
        fields.append(("forked from", f"{run.forked_from_id} at step {run.fork_seq}"))
    if run.concurrency_key:
        fields.append(("concurrency key", one_line(run.concurrency_key)))
    if run.start_key:
        fields.append(("start key", one_line(run.start_key)))
    if run.metadata:
        fields.append(("metadata", one_line(json.dumps(run.metadata, ensure_ascii=False))))
    fields.append(("tokens", str(run.tokens_used)))
    fields.append(("cost", _cost_text(run.cost_usd, run.tokens_used)))
    if family.descendants:
        at_least = "" if family.complete else "at least "
        fields.append(
            (
                "with descendants",
                f"{at_least}{_cost_text(family.cost, 1)} ({family.descendants} descendant runs)",
            )
        )
    width = max(len(name) for name, _ in fields) + 1
    lines = [f"{(name + ':').ljust(width)} {value}" for name, value in fields]
    if run.result is not None:
        lines.append("result:")
        lines += lines_of(_cut(run.result))
    if run.error:
        lines.append("error:")
        lines += lines_of(_cut(run.error))
    lines.append("task:")
    lines += lines_of(_cut(run.task))
    return lines


def _cost_text(cost: Decimal | None, tokens: int) -> str:
    if cost is not None:
        return usd(cost)
    return "no price" if tokens else "-"


# -- intents ---------------------------------------------------------------------------------


def intent_document(intent: ToolIntent) -> dict[str, Any]:
    return {
        "id": intent.pk,
        "run_id": str(intent.run_id),
        "run_short_id": short_id(intent.run_id),
        "seq": intent.seq,
        "call_index": intent.call_index,
        "tool": intent.tool,
        "input": intent.input,
        "status": intent.status,
        "created_at": iso_exact(intent.created_at),
        "decided_by": intent.decided_by.get_username() if intent.decided_by else None,
        "decided_at": iso_exact(intent.decided_at),
        "reason": intent.reason or None,
    }


def input_text(value: Any) -> str:
    """An intent's input as JSON text (as given, when it could not be decrypted)."""
    if isinstance(value, str) and value.startswith("[cannot decrypt"):
        return value
    return json.dumps(value, ensure_ascii=False, sort_keys=False)


def list_intents(*, statuses: list[str], limit: int) -> Output:
    """Intents waiting for a person first (oldest first), then the others (newest first)."""
    intents = ToolIntent.objects.select_related("decided_by")
    if statuses:
        intents = intents.filter(status__in=statuses)
    queue = intents.filter(status__in=AWAITING_PERSON).order_by("created_at", "pk")
    history = intents.exclude(status__in=AWAITING_PERSON).order_by("-created_at", "-pk")
    found = list(queue[:limit])
    if len(found) < limit:
        found += list(history[: limit - len(found)])
    documents = [intent_document(intent) for intent in found]
    rows = [
        [
            str(doc["id"]),
            doc["run_short_id"],
            one_line(doc["tool"], 40),
            doc["status"],
            iso(intent.created_at),
            one_line(input_text(doc["input"]), HEAD_CHARS),
        ]
        for doc, intent in zip(documents, found, strict=True)
    ]
    lines = table(["ID", "RUN", "TOOL", "STATUS", "CREATED", "INPUT"], rows)
    return Output(
        {"count": len(documents), "limit": limit, "intents": documents},
        lines or ["No intents match."],
    )


def intent_lines(intent: ToolIntent) -> list[str]:
    """An intent in full: what will run (its tool and exact input) if it is approved."""
    lines = [
        f"intent {intent.pk}: {one_line(intent.tool, 200)} for run {intent.run_id} "
        f"({short_id(intent.run_id)}), {intent.status}",
        "input:",
        *lines_of(input_text(intent.input)),
    ]
    if intent.decided_by is not None or intent.decided_at is not None:
        who = one_line(intent.decided_by.get_username()) if intent.decided_by else "nobody"
        lines.append(f"decided by {who} at {iso(intent.decided_at)}")
    if intent.reason:
        lines.append("reason:")
        lines += lines_of(intent.reason)
    return lines


# -- workers ---------------------------------------------------------------------------------


def list_workers() -> Output:
    """Every worker row, live ones first; live by the database's clock (its last beat within
    a lease)."""
    workers = list(
        AgentWorker.objects.annotate(
            live=Case(
                When(alive_until__gt=Now(), then=Value(True)),
                default=Value(False),
                output_field=BooleanField(),
            )
        ).order_by(F("live").desc(), "id")
    )
    documents = []
    rows = []
    for worker in workers:
        live: bool = worker.live  # type: ignore[attr-defined]
        versions = [
            {key: str(v.get(key, "")) for key in ("agent", "version", "model", "fingerprint")}
            for v in worker.defined()
        ]
        documents.append(
            {
                "id": worker.id,
                "host": worker.host,
                "pid": worker.pid,
                "started_at": iso_exact(worker.started_at),
                "beat_at": iso_exact(worker.beat_at),
                "alive_until": iso_exact(worker.alive_until),
                "live": live,
                "concurrency": worker.concurrency,
                "runs_held": worker.runs_held,
                "draining": worker.draining,
                "versions": versions,
            }
        )
        rows.append(
            [
                one_line(worker.id, 60),
                one_line(worker.host, 40),
                str(worker.pid),
                iso(worker.started_at),
                iso(worker.beat_at),
                "live" if live else "gone",
                str(worker.concurrency),
                str(worker.runs_held),
                "yes" if worker.draining else "no",
                one_line(", ".join(worker.labels()), 200),
            ]
        )
    headers = [
        "WORKER",
        "HOST",
        "PID",
        "STARTED",
        "LAST BEAT",
        "STATE",
        "SLOTS",
        "HELD",
        "DRAINING",
        "VERSIONS",
    ]
    live_count = sum(1 for doc in documents if doc["live"])
    lines = table(headers, rows) or ["No worker rows."]
    return Output({"count": len(documents), "live": live_count, "workers": documents}, lines)
