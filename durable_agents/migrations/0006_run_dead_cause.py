"""``agent_run.dead_cause``: a dead run's reason with its variable parts folded away, what the
dead-letter page groups on (``durable_agents.causes``). The runs that are dead already get
theirs here, a thousand at a time. One transaction: an interrupted deploy leaves no half."""

from __future__ import annotations

from typing import Any

from django.db import migrations, models

from durable_agents.causes import backfill_causes


def backfill_dead_causes(apps: Any, schema_editor: Any) -> None:
    backfill_causes(apps.get_model("durable_agents", "AgentRun"))


class Migration(migrations.Migration):
    dependencies = [
        ("durable_agents", "0005_run_trace_context"),
    ]

    operations = [
        migrations.AddField(
            model_name="agentrun",
            name="dead_cause",
            field=models.CharField(
                blank=True, db_default="", default="", editable=False, max_length=255
            ),
        ),
        migrations.RunPython(backfill_dead_causes, migrations.RunPython.noop),
    ]
