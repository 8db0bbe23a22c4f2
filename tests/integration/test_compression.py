"""Large payloads are compressed with lz4 on PostgreSQL servers that have it (migration 0023),
and read back byte for byte."""

from __future__ import annotations

import importlib
from typing import Any

import pytest
from django.db import connection

from durable_agents.api import start_run
from durable_agents.models import AgentStep, StepKind, steps_of

MIGRATION = importlib.import_module("durable_agents.migrations.0023_lz4_payloads")
COLUMNS = MIGRATION.COLUMNS

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


def server_has_lz4() -> bool:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT 'lz4' = ANY(enumvals) FROM pg_settings WHERE name = 'default_toast_compression'"
        )
        row = cursor.fetchone()
    return bool(row and row[0])


def methods() -> set[str]:
    with connection.cursor() as cursor:
        found = set()
        for table, column in COLUMNS:
            cursor.execute(
                "SELECT attcompression FROM pg_attribute"
                " WHERE attrelid = %s::regclass AND attname = %s",
                [table, column],
            )
            (method,) = cursor.fetchone()
            found.add(str(method))
    return found


class Editor:
    """What the migration's functions use of a schema editor: its connection."""

    connection: Any = connection


def test_the_payload_columns_use_lz4_where_the_server_has_it() -> None:
    assert methods() == ({"l"} if server_has_lz4() else {""})


def test_a_large_payload_is_stored_with_lz4_and_read_back_exactly() -> None:
    run = start_run("tester", "hello")
    text = (
        '{"rows": ['
        + ", ".join(f'{{"id": {i}, "note": "row {i} of the report"}}' for i in range(4000))
        + "]}"
    )
    AgentStep.objects.create(
        run=run, seq=1, kind=StepKind.TOOL_RESULT, payload=text, attempt=1, worker="t"
    )
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pg_column_compression(payload), octet_length(payload),"
            " pg_column_size(payload) FROM agent_step WHERE run_id = %s AND seq = 1",
            [run.pk],
        )
        method, length, stored = cursor.fetchone()
    assert length == len(text.encode())
    assert stored < length / 2  # compressed, by whichever method the server has
    assert method == ("lz4" if server_has_lz4() else "pglz")
    assert steps_of(run.pk).get(seq=1).payload == text


def test_the_migration_goes_back_and_forth() -> None:
    if not server_has_lz4():
        MIGRATION.to_lz4(None, Editor())  # a server without lz4: nothing to do
        assert methods() == {""}
        return
    try:
        MIGRATION.to_default(None, Editor())
        assert methods() == {""}
        MIGRATION.to_lz4(None, Editor())
        MIGRATION.to_lz4(None, Editor())  # again: nothing left to change
        assert methods() == {"l"}
    finally:
        MIGRATION.to_lz4(None, Editor())
