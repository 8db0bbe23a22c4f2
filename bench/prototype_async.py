"""PROTOTYPE: an asyncio worker, to measure against the threaded worker on the same workload.

    python -m bench.prototype_async --concurrency N --database-url postgres://.../da_bench...
        --base-url http://127.0.0.1:PORT [--burst] [--pool-size 8]

Not product code: a bench tool for a design decision (threaded worker releasing its Django
connection between statements vs an asyncio worker). It does the durable work honestly:

* runs are claimed with ``store.postgres.CLAIM_SQL`` (lease 60 s, owner ``proto:<pid>``), up to
  ``concurrency - in_flight`` at once, by one claimer task; one asyncio task per run;
* every step is committed with the fenced append statement of ``store.postgres``
  (``APPEND_STEP_SQL``, ``APPEND_LAST_STEP_SQL`` for the final turn, the effects variant for
  tool results, which records the tool_effect row as the real worker does) before the next
  model call goes out: no overlap of a tool_result commit with the next call (the real worker
  overlaps them for pure tools, OVERLAP_SAFE_COMMITS);
* one heartbeat task renews every held lease in one statement every 20 s; a run whose lease
  is gone is cancelled.

Django is set up only to read the registered agent's pinned request and its tools; the hot path
goes through ``psycopg_pool.AsyncConnectionPool`` and ``anthropic.AsyncAnthropic``.
Left out (prototype): model retries (a failed call hands the run back, held for a lease period),
budgets (max_turns etc.), non-pure tools, approvals, streaming, cancellation by NOTIFY.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import time
import uuid
from collections.abc import Sequence
from typing import Any

OWNER = f"proto:{os.getpid()}"
LEASE_SECONDS = 60.0
HEARTBEAT_SECONDS = 20.0
POLL_SECONDS = 0.05
MESSAGES_PATH = "/v1/messages"

# Every held lease renewed in one statement; what is not returned is no longer ours.
_RENEW_ALL_SQL = """
UPDATE agent_run AS run
   SET lease_until = now() + make_interval(secs => %(lease)s),
       updated_at = now()
  FROM unnest(%(ids)s::uuid[], %(attempts)s::int[]) AS held(id, attempt)
 WHERE run.id = held.id
   AND run.attempt = held.attempt
   AND run.lease_owner = %(owner)s
   AND run.status = 'running'
RETURNING run.id"""

# Store.release_lease / finish_run, fenced, in plain SQL.
_FENCE = """ WHERE id = %(run_id)s AND lease_owner = %(owner)s AND attempt = %(attempt)s
   AND status = 'running'"""
_RELEASE_SQL = (
    """UPDATE agent_run
   SET status = 'pending', lease_owner = NULL,
       lease_until = now() + make_interval(secs => %(hold)s),
       error = %(error)s, updated_at = now()"""
    + _FENCE
)
_SHUTDOWN_RELEASE_SQL = (
    """UPDATE agent_run
   SET status = 'pending', lease_owner = NULL, lease_until = NULL,
       stalled_claims = greatest(stalled_claims - 1, 0), updated_at = now()"""
    + _FENCE
)
_FINISH_SQL = (
    """UPDATE agent_run
   SET status = %(status)s, result = %(result)s, error = '', lease_owner = NULL,
       lease_until = NULL, finished_at = now(), updated_at = now()"""
    + _FENCE
)
_LOG_SQL = (
    "SELECT seq, kind, payload, content_start, content_end FROM agent_step"
    " WHERE run_id = %s ORDER BY seq"
)


class FenceFailed(Exception):
    """The run is no longer this claim's (cancelled, taken over): stop, commit nothing."""


class Worker:
    def __init__(self, args: argparse.Namespace) -> None:
        import anthropic
        import httpx2
        from psycopg_pool import AsyncConnectionPool

        from durable_agents.conf import app_settings

        self.concurrency: int = args.concurrency
        self.burst: bool = args.burst
        self.pool = AsyncConnectionPool(
            args.database_url,
            min_size=1,
            max_size=args.pool_size,
            # Each statement commits on its own; statements are prepared as in bench.settings.
            kwargs={"autocommit": True, "prepare_threshold": 5},
            open=False,
        )
        self.client = anthropic.AsyncAnthropic(
            base_url=args.base_url,
            api_key="x",
            max_retries=0,
            timeout=app_settings.MODEL_TIMEOUT,
            http_client=anthropic.DefaultAsyncHttpxClient(
                limits=httpx2.Limits(
                    max_connections=None, max_keepalive_connections=args.concurrency
                )
            ),
        )
        self.response_type = httpx2.Response
        # run id -> (attempt, task)
        self.held: dict[uuid.UUID, tuple[int, asyncio.Task[None]]] = {}
        self.lost: set[uuid.UUID] = set()
        self.slot_freed = asyncio.Event()
        self.runs_done = 0
        self.runs_released = 0
        self.runs_lost = 0
        self.steps = 0

    # -- SQL ---------------------------------------------------------------------------------

    async def claim(self, limit: int) -> list[dict[str, Any]]:
        from psycopg.rows import dict_row

        from durable_agents.store.postgres import CLAIM_SQL

        params = {"owner": OWNER, "lease": LEASE_SECONDS, "limit": limit}
        async with self.pool.connection() as conn, conn.cursor(row_factory=dict_row) as cur:
            await cur.execute(CLAIM_SQL, params)
            rows = await cur.fetchall()
        return sorted(rows, key=lambda row: row["created_at"])

    async def execute(self, sql: str, params: Any) -> int:
        async with self.pool.connection() as conn:
            cur = await conn.execute(sql, params)
            return cur.rowcount

    async def append(
        self,
        fence: dict[str, Any],
        seq: int,
        kind: str,
        payload: str,
        *,
        request_id: str | None = None,
        span: tuple[int, int] | None = None,
        tokens: int = 0,
        finish: tuple[str, str | None] | None = None,
        effects: Sequence[tuple[str, int, int, str, str, bool]] = (),
    ) -> None:
        """Store.append_step on the async pool: one fenced statement; raises FenceFailed."""
        from durable_agents.store import postgres
        from durable_agents.text import storable_text

        params: dict[str, Any] = {
            **fence,
            "lease": LEASE_SECONDS,
            "seq": seq,
            "kind": kind,
            "payload": payload,
            "content_start": span[0] if span else None,
            "content_end": span[1] if span else None,
            "request_id": request_id,
            "tokens": tokens,
        }
        if effects:
            rows = []
            for i, (key, e_seq, index, tool, result, is_error) in enumerate(effects):
                rows.append(
                    f"(%(k{i})s, %(run_id)s, %(s{i})s, %(c{i})s, %(t{i})s, %(r{i})s, %(e{i})s)"
                )
                params.update(
                    {
                        f"k{i}": key,
                        f"s{i}": e_seq,
                        f"c{i}": index,
                        f"t{i}": tool,
                        f"r{i}": postgres.RESULT_FIELD.get_prep_value(result),
                        f"e{i}": is_error,
                    }
                )
            template = (
                postgres.APPEND_STEP_WITH_EFFECTS_SQL
                if finish is None
                else postgres.APPEND_LAST_STEP_WITH_EFFECTS_SQL
            )
            sql = template.format(rows=", ".join(rows))
        else:
            sql = postgres.APPEND_STEP_SQL if finish is None else postgres.APPEND_LAST_STEP_SQL
        if finish is not None:
            params["status"] = finish[0]
            params["result"] = None if finish[1] is None else storable_text(finish[1])
        if await self.execute(sql, params) != 1:
            raise FenceFailed(f"seq {seq} not appended")
        self.steps += 1

    async def load_log(self, run_id: uuid.UUID) -> list[tuple[Any, ...]]:
        async with self.pool.connection() as conn:
            cur = await conn.execute(_LOG_SQL, [run_id])
            return await cur.fetchall()

    # -- one run -----------------------------------------------------------------------------

    async def run_one(self, row: dict[str, Any]) -> None:
        from durable_agents.text import storable_text

        run_id: uuid.UUID = row["id"]
        fence = {"run_id": run_id, "owner": OWNER, "attempt": row["attempt"]}
        try:
            await self.advance(row, fence)
            self.runs_done += 1
        except FenceFailed:
            self.runs_lost += 1
        except asyncio.CancelledError:
            if run_id in self.lost:
                self.runs_lost += 1
            else:  # shutting down: hand the run back, not counted as a stalled claim
                with contextlib.suppress(Exception):
                    await asyncio.shield(self.execute(_SHUTDOWN_RELEASE_SQL, fence))
                self.runs_released += 1
            raise
        except Exception as exc:  # noqa: BLE001 - the prototype hands the run back, held
            if self.runs_released < 5:
                print(f"run {run_id}: {type(exc).__name__}: {exc}", flush=True)
            error = storable_text(f"prototype: {type(exc).__name__}: {exc}", 20_000)
            await self.execute(_RELEASE_SQL, {**fence, "hold": LEASE_SECONDS, "error": error})
            self.runs_released += 1
        finally:
            self.held.pop(run_id, None)
            self.slot_freed.set()

    async def advance(self, row: dict[str, Any], fence: dict[str, Any]) -> None:
        from durable_agents import effects
        from durable_agents.agents import registry
        from durable_agents.deepjson import loads_deep
        from durable_agents.history import (
            Conversation,
            assistant_message,
            message_text,
            task_log,
            user_message,
        )
        from durable_agents.llm import content_span, request_body
        from durable_agents.models import StepKind
        from durable_agents.runner import FINAL_STOP_REASONS, text_of, tokens_of
        from durable_agents.text import json_text, storable_text

        model_turn, tool_result = StepKind.MODEL_TURN.value, StepKind.TOOL_RESULT.value
        agent = registry.get(row["agent"], row["prompt_version"])
        params = agent.request_for(row["model"])
        run_id: uuid.UUID = row["id"]

        if row["task_payload"] is not None:  # a fresh run: its log came with the claim
            conversation = task_log(row["task_payload"]).conversation
            seq, kind, message = 0, StepKind.TASK.value, None
        else:  # resumed: rebuilt from the log, as history.load_log does
            rows = await self.load_log(run_id)
            conversation = Conversation(
                ",".join(message_text(k, p, s, e) for _, k, p, s, e in rows).encode(), len(rows)
            )
            seq, kind, payload = rows[-1][:3]
            message = loads_deep(payload)

        while True:
            if kind != model_turn or message.get("stop_reason") == "pause_turn":
                body = request_body(params, conversation.json())
                response = await self.client.post(
                    MESSAGES_PATH, cast_to=self.response_type, content=body
                )
                # The body verbatim, its content span and the provider's request id, as the
                # real worker keeps them.
                text = response.content.decode("utf-8")
                message = loads_deep(text)
                if not isinstance(message, dict) or not isinstance(message.get("content"), list):
                    raise RuntimeError("the answer is not a Messages API message")
                span = content_span(text)
                request_id = response.headers.get("request-id")
                if request_id is not None:
                    request_id = storable_text(request_id)[:200]
                seq += 1
                final = message.get("stop_reason") in FINAL_STOP_REASONS
                await self.append(
                    fence,
                    seq,
                    model_turn,
                    text,
                    request_id=request_id,
                    span=span,
                    tokens=tokens_of(message),
                    finish=("succeeded", text_of(message)) if final else None,
                )
                if final:
                    return
                conversation.append(assistant_message(text, span))
                kind = model_turn
                continue

            stop_reason = message.get("stop_reason")
            if stop_reason in FINAL_STOP_REASONS:  # committed by an earlier claim
                result = text_of(message)
                done = await self.execute(
                    _FINISH_SQL, {**fence, "status": "succeeded", "result": result}
                )
                if not done:
                    raise FenceFailed("finish")
                return
            if stop_reason != "tool_use":
                raise RuntimeError(f"stop_reason={stop_reason!r} (not handled by the prototype)")
            # Pure tools only, called in order on the loop (they are trivial); as runner does.
            results: list[dict[str, Any]] = []
            recorded: list[tuple[str, int, int, str, str, bool]] = []
            calls = [b for b in message.get("content") or [] if b.get("type") == "tool_use"]
            for index, call in enumerate(calls):
                name, tool_input = call.get("name", ""), call.get("input")
                key = effects.idempotency_key(run_id, seq, index, name, tool_input)
                tool = agent.tools_by_name.get(name)
                if tool is None or tool.effect != "pure":
                    raise RuntimeError(f"tool {name!r}: only pure tools in the prototype")
                try:
                    text, is_error = effects.format_result(tool.func(**tool_input))
                except Exception as exc:  # noqa: BLE001 - the tool's failure is the model's news
                    text, is_error = effects.tool_error_text(tool.name, exc), True
                block: dict[str, Any] = {
                    "type": "tool_result",
                    "tool_use_id": call.get("id", ""),
                    "content": text,
                }
                if is_error:
                    block["is_error"] = True
                results.append(block)
                recorded.append((key, seq, index, tool.name, text, is_error))
            payload = json_text(results)
            await self.append(fence, seq + 1, tool_result, payload, effects=recorded)
            seq += 1
            conversation.append(user_message(payload))
            kind, message = tool_result, results

    # -- claimer and heartbeat ---------------------------------------------------------------

    async def heartbeat(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_SECONDS)
            held = list(self.held.items())
            if not held:
                continue
            params = {
                "lease": LEASE_SECONDS,
                "owner": OWNER,
                "ids": [run_id for run_id, _ in held],
                "attempts": [attempt for _, (attempt, _) in held],
            }
            async with self.pool.connection() as conn:
                cur = await conn.execute(_RENEW_ALL_SQL, params)
                kept = {r[0] for r in await cur.fetchall()}
            for run_id, (_, task) in held:
                if run_id not in kept and run_id in self.held:
                    self.lost.add(run_id)
                    task.cancel()

    async def claimer(self) -> None:
        while True:
            free = self.concurrency - len(self.held)
            rows = await self.claim(free) if free > 0 else []
            for row in rows:
                task = asyncio.create_task(self.run_one(row))
                self.held[row["id"]] = (row["attempt"], task)
            if rows:
                continue
            if not self.held and self.burst:
                return
            self.slot_freed.clear()
            if free > 0:  # nothing claimable now: poll, or wake early when a slot frees
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.slot_freed.wait(), POLL_SECONDS)
            else:
                await self.slot_freed.wait()

    async def main(self) -> float:
        await self.pool.open(wait=True)
        beat = asyncio.create_task(self.heartbeat())
        started = time.perf_counter()
        try:
            await self.claimer()
            return time.perf_counter() - started
        finally:
            beat.cancel()
            tasks = [task for _, task in self.held.values()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(beat, *tasks, return_exceptions=True)
            await self.client.close()
            await self.pool.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, required=True)
    parser.add_argument("--database-url", required=True)
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--burst", action="store_true", help="exit when no run is left")
    parser.add_argument("--pool-size", type=int, default=8)
    args = parser.parse_args(argv)

    from bench.common import setup_django

    setup_django(args.database_url, args.base_url)
    made: list[Worker] = []

    async def run() -> float:
        made.append(Worker(args))  # pool, client and event made inside the running loop
        return await made[0].main()

    try:
        seconds = asyncio.run(run())
    except KeyboardInterrupt:
        seconds = float("nan")
    if not made:
        return 1
    worker = made[0]
    print(
        f"runs={worker.runs_done} steps={worker.steps} seconds={seconds:.3f} "
        f"steps/s={worker.steps / seconds if seconds else 0:.0f} "
        f"released={worker.runs_released} lost={worker.runs_lost} "
        f"concurrency={args.concurrency} pool={args.pool_size}",
        flush=True,
    )
    return 0 if worker.runs_released == 0 and worker.runs_lost == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
