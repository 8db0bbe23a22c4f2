"""New runs get time-ordered ids (durable_agents.models.ids.new_run_id). The default is made
in Python, so nothing changes in the database (state only: SQLite would otherwise copy the
whole run table to change a default it never stores)."""

from django.db import migrations, models

import durable_agents.models.ids


class Migration(migrations.Migration):
    dependencies = [
        ("durable_agents", "0023_lz4_payloads"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AlterField(
                    model_name="agentrun",
                    name="id",
                    field=models.UUIDField(
                        default=durable_agents.models.ids.new_run_id,
                        editable=False,
                        primary_key=True,
                        serialize=False,
                    ),
                ),
            ],
        ),
    ]
