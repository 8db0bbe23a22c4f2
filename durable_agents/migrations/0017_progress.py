"""``agent_progress``: the progress(...) messages of tool calls, kept with their run and
streamed to whoever watches it. A new, empty table: nothing to backfill, no lock on others."""

import django.db.models.deletion
import django.db.models.functions.datetime
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('durable_agents', '0016_fork'),
    ]

    operations = [
        migrations.CreateModel(
            name='AgentProgress',
            fields=[
                ('id', models.BigAutoField(primary_key=True, serialize=False)),
                ('seq', models.IntegerField()),
                ('message', models.TextField()),
                ('created_at', models.DateTimeField(db_default=django.db.models.functions.datetime.Now(), editable=False)),
                ('run', models.ForeignKey(db_index=False, on_delete=django.db.models.deletion.CASCADE, related_name='progress_messages', to='durable_agents.agentrun')),
            ],
            options={
                'db_table': 'agent_progress',
                'ordering': ['run_id', 'id'],
                'indexes': [models.Index(fields=['run', 'id'], name='agent_progress_run')],
            },
        ),
    ]
