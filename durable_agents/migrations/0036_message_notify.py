"""PostgreSQL notifies the workers' channel with ``inbox:<run id>`` when a message is queued.

A worker then knows, without a statement, that nothing was queued for a run it holds since it
last looked at the run's inbox: the turns in between skip the look (engine/inbox_hint.py). A
trigger, as for the other notifications (migrations 0003 and 0033), so that every way a
message is queued notifies (``send_message`` from any process and any version of this app, a
hand-written INSERT), and at commit, so that the worker that hears it finds the message. The
workers' channel: the worker holding the run is one of its listeners. SQLite has no
notifications: its workers look before every model call.

The trigger is created with a short lock_timeout, tried again until it gets its lock, so that
a long transaction holding agent_message never queues every fold behind it.
"""

from __future__ import annotations

import importlib
from typing import Any

from django.db import migrations

# The lock_timeout loop of migration 0033.
_briefly = importlib.import_module("durable_agents.migrations.0033_run_end_notify")._briefly

FUNCTION = """
CREATE OR REPLACE FUNCTION durable_agents_notify_message() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('durable_agents', 'inbox:' || NEW.run_id::text);
    RETURN NULL;
END
$$
"""

TRIGGER = """
CREATE TRIGGER agent_message_notify_insert
    AFTER INSERT ON agent_message
    FOR EACH ROW
    EXECUTE FUNCTION durable_agents_notify_message()
"""


def create(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor != "postgresql":
        return
    _briefly(
        schema_editor,
        FUNCTION,
        "DROP TRIGGER IF EXISTS agent_message_notify_insert ON agent_message",
        TRIGGER,
    )


def drop(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor != "postgresql":
        return
    _briefly(
        schema_editor,
        "DROP TRIGGER IF EXISTS agent_message_notify_insert ON agent_message",
        "DROP FUNCTION IF EXISTS durable_agents_notify_message()",
    )


class Migration(migrations.Migration):
    atomic = False  # _briefly commits its own transaction

    dependencies = [("durable_agents", "0035_batches")]

    operations = [migrations.RunPython(create, drop, elidable=False)]
