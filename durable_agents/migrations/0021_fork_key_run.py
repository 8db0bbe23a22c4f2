"""``agent_run.fork_key_run_id``: for a fork made at a model turn, the run whose id the
idempotency keys of that turn's calls are derived from, so that a call the original may have
made (in flight when it was forked) keeps the original's key.

A nullable column without a default: PostgreSQL changes its catalogue only (no rewrite of
agent_run, no scan); existing runs read NULL, which means "the run's own id", as before.
"""

from __future__ import annotations

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("durable_agents", "0020_schedule_plural"),
    ]

    operations = [
        migrations.AddField(
            model_name="agentrun",
            name="fork_key_run_id",
            field=models.UUIDField(blank=True, editable=False, null=True),
        ),
    ]
