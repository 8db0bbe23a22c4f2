"""Bytes per step with pglz and with lz4 TOAST compression, and what each costs to write and read.

Two copies of ``agent_step`` (``CREATE TABLE ... (LIKE agent_step INCLUDING ALL)``: the same
columns, indexes and defaults) differ only in the compression of ``payload``: pglz, the
server's default, and lz4, what migration 0023 sets. The same steps go into both, block by
block in turn (so a drift of the machine's speed hits both alike):

    small   (80 %)  a model turn or a tool result of 200 B to 1.5 kB: under the TOAST
                    threshold (about 2 kB), stored as it is by either method
    medium  (15 %)  2 to 16 kB: a long answer, a page of rows
    large   (5 %)   32 to 256 kB: a file, a log, a big query result

Each payload is JSON of English-like words and numbers (what model turns and tool results
look like, and about as compressible); ``--encrypted`` writes what ``ENCRYPTION_KEYS`` stores
instead (base64 of random bytes, which no method compresses). Printed: the bytes per step of
each table (heap, TOAST and indexes: ``pg_total_relation_size``), the time to insert the steps
(one transaction per block) and to read every payload back (decompressing it).

    python -m bench.compression                    # 20,000 steps, on a fresh da_bench_compression
    python -m bench.compression --steps 5000 --encrypted
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import random
import statistics
import time
import uuid
from typing import Any

from bench import common
from bench.common import log

DB = "da_bench_compression"
TABLES = {"pglz": "bench_step_pglz", "lz4": "bench_step_lz4"}
# fmt: off
WORDS = [
    "the", "order", "customer", "table", "migration", "ticket", "payment", "refund", "account",
    "invoice", "status", "shipped", "pending", "failed", "retry", "user", "email", "address",
    "amount", "currency", "total", "line", "item", "product", "warehouse", "region", "report",
    "summary", "error", "warning", "row", "column", "index", "query", "result", "value", "date",
    "time", "week",
]
# fmt: on


def payload_of(size: int, rng: random.Random, encrypted: bool) -> str:
    """About ``size`` characters of a step's JSON text (or of its ciphertext)."""
    if encrypted:
        return "da:enc:v1:k1:" + base64.b64encode(os.urandom(size * 3 // 4)).decode()
    rows: list[dict[str, Any]] = []
    length = 0
    while length < size:
        row = {
            "id": rng.randrange(10**9),
            "text": " ".join(rng.choice(WORDS) for _ in range(rng.randrange(4, 24))),
            "amount": round(rng.uniform(0, 10_000), 2),
        }
        rows.append(row)
        length += len(json.dumps(row)) + 2
    return json.dumps({"role": "assistant", "content": [{"type": "text", "rows": rows}]})


def size_of_step(rng: random.Random) -> int:
    draw = rng.random()
    if draw < 0.80:
        return rng.randrange(200, 1_500)
    if draw < 0.95:
        return rng.randrange(2_000, 16_000)
    return rng.randrange(32_000, 256_000)


def create_tables(cursor: Any) -> None:
    for method, table in TABLES.items():
        cursor.execute(f"DROP TABLE IF EXISTS {table}")
        cursor.execute(f"CREATE TABLE {table} (LIKE agent_step INCLUDING ALL)")
        cursor.execute(f"ALTER TABLE {table} ALTER COLUMN payload SET COMPRESSION {method}")


def insert_block(cursor: Any, table: str, rows: list[tuple[Any, ...]]) -> float:
    started = time.perf_counter()
    cursor.execute("BEGIN")
    cursor.executemany(
        f"INSERT INTO {table} (run_id, seq, kind, payload, attempt, worker)"
        " VALUES (%s, %s, 'model_turn', %s, 1, 'bench')",
        rows,
    )
    cursor.execute("COMMIT")
    return time.perf_counter() - started


def read_all(cursor: Any, table: str) -> float:
    started = time.perf_counter()
    cursor.execute(f"SELECT sum(length(payload)) FROM {table}")  # detoasts every payload
    cursor.fetchone()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=20_000)
    parser.add_argument("--blocks", type=int, default=10)
    parser.add_argument("--reads", type=int, default=3)
    parser.add_argument("--encrypted", action="store_true")
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    if reason := common.postgres_unavailable():
        raise SystemExit(f"bench.compression needs PostgreSQL: {reason}")
    url = common.fresh_db(DB)
    import psycopg

    rng = random.Random(args.seed)
    per_block = args.steps // args.blocks
    insert_seconds: dict[str, list[float]] = {method: [] for method in TABLES}
    payload_bytes = 0
    with psycopg.connect(url, autocommit=True) as conn:
        cursor = conn.cursor()
        cursor.execute(
            "SELECT 'lz4' = ANY(enumvals) FROM pg_settings WHERE name = 'default_toast_compression'"
        )
        row = cursor.fetchone()
        if not (row and row[0]):
            raise SystemExit("this PostgreSQL server was built without lz4")
        create_tables(cursor)
        run_id = uuid.uuid4()
        for block in range(args.blocks):
            rows = []
            for i in range(per_block):
                text = payload_of(size_of_step(rng), rng, args.encrypted)
                payload_bytes += len(text.encode())
                rows.append((run_id, block * per_block + i, text))
            order = list(TABLES.items()) if block % 2 == 0 else list(TABLES.items())[::-1]
            for method, table in order:
                insert_seconds[method].append(insert_block(cursor, table, rows))
            log(f"block {block + 1}/{args.blocks}: {per_block} steps into both tables")
        cursor.execute("VACUUM ANALYZE")
        steps = per_block * args.blocks
        result: dict[str, Any] = {
            "steps": steps,
            "encrypted": args.encrypted,
            "payload_bytes_per_step": round(payload_bytes / steps),
        }
        for method, table in TABLES.items():
            cursor.execute(
                "SELECT pg_total_relation_size(%s::regclass),"
                " (SELECT count(*) FROM " + table + " WHERE pg_column_compression(payload) = %s)",
                [table, method],
            )
            total, compressed = cursor.fetchone()  # type: ignore[misc]
            reads = [read_all(cursor, table) for _ in range(args.reads)]
            result[method] = {
                "bytes_per_step": round(total / steps),
                "compressed_steps": compressed,
                "insert_ms_per_step": round(1000 * sum(insert_seconds[method]) / steps, 4),
                "read_all_ms_median": round(1000 * statistics.median(reads), 1),
            }
    ratio = {
        key: round(result["lz4"][key] / result["pglz"][key], 3)
        for key in ("bytes_per_step", "insert_ms_per_step", "read_all_ms_median")
        if result["pglz"][key]
    }
    result["lz4_to_pglz"] = ratio
    kind = "ciphertext" if args.encrypted else "JSON text"
    print(
        f"[compression] {steps} steps of {kind}, {result['payload_bytes_per_step']} B of payload"
        f" per step on average: pglz {result['pglz']['bytes_per_step']} B/step"
        f" ({result['pglz']['compressed_steps']} compressed), lz4"
        f" {result['lz4']['bytes_per_step']} B/step ({result['lz4']['compressed_steps']}"
        f" compressed); lz4/pglz: size {ratio.get('bytes_per_step')}, insert"
        f" {ratio.get('insert_ms_per_step')}, read back {ratio.get('read_all_ms_median')}"
    )
    common.finish("compression_encrypted" if args.encrypted else "compression", result, DB)


if __name__ == "__main__":
    main()
