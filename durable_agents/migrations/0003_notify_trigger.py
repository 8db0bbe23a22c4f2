"""PostgreSQL notifies workers when a run may be claimed or was cancelled (LISTEN/NOTIFY).

A trigger rather than a ``pg_notify`` call in each Python operation: every way a run is
created, woken, handed back or cancelled notifies (``start_run``, the admin, a requeue, a
person's decision, a bulk INSERT in an incident), and the notification is sent at commit, so
a worker never claims before the row is visible. Notifications with the same payload in one
transaction are folded into one: a bulk insert wakes the workers once.

Payloads on the channel ``durable_agents``: ``run`` (a run became pending) and
``cancel:<run id>``. SQLite has no notifications: its workers poll.
"""

from django.db import migrations

CREATE = """
CREATE OR REPLACE FUNCTION durable_agents_notify() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.status = 'cancelled' THEN
        PERFORM pg_notify('durable_agents', 'cancel:' || NEW.id::text);
    ELSE
        PERFORM pg_notify('durable_agents', 'run');
    END IF;
    RETURN NULL;
END
$$;

CREATE TRIGGER agent_run_notify_insert
    AFTER INSERT ON agent_run
    FOR EACH ROW WHEN (NEW.status = 'pending')
    EXECUTE FUNCTION durable_agents_notify();

CREATE TRIGGER agent_run_notify_update
    AFTER UPDATE OF status ON agent_run
    FOR EACH ROW WHEN (
        NEW.status IN ('pending', 'cancelled') AND OLD.status IS DISTINCT FROM NEW.status
    )
    EXECUTE FUNCTION durable_agents_notify();
"""

DROP = """
DROP TRIGGER IF EXISTS agent_run_notify_update ON agent_run;
DROP TRIGGER IF EXISTS agent_run_notify_insert ON agent_run;
DROP FUNCTION IF EXISTS durable_agents_notify();
"""


def create(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(CREATE)


def drop(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(DROP)


class Migration(migrations.Migration):
    dependencies = [("durable_agents", "0002_step_content_span_run_tokens")]

    operations = [migrations.RunPython(create, drop, elidable=False)]
