"""``agent_callback``: the bodies services POST to the signed URL of a call that waits with
``Wait(callback=True)``, one per call (its idempotency key, unique), and a new choice of
agent_run.waiting_for ('callback'), which changes no column: a new table and no lock on
existing ones.
"""

import django.db.models.deletion
import django.db.models.functions.datetime
from django.db import migrations, models

import durable_agents.models.fields


class Migration(migrations.Migration):

    dependencies = [
        ('durable_agents', '0031_run_output'),
    ]

    operations = [
        migrations.AlterField(
            model_name='agentrun',
            name='waiting_for',
            field=models.CharField(blank=True, choices=[('intent', 'an approval'), ('timer', 'a timer'), ('event', 'an event'), ('runs', 'child runs'), ('question', 'an answer'), ('callback', 'a callback'), ('capacity', 'model capacity'), ('budget', "its key's budget"), ('debounce', 'a quiet window'), ('worker', 'a worker that defines its version')], db_default='', default='', max_length=16),
        ),
        migrations.CreateModel(
            name='AgentCallback',
            fields=[
                ('id', models.BigAutoField(primary_key=True, serialize=False)),
                ('key', models.CharField(max_length=64, unique=True)),
                ('body', durable_agents.models.fields.JSONTextField(blank=True, encrypted=True, null=True)),
                ('received_at', models.DateTimeField(db_default=django.db.models.functions.datetime.Now(), editable=False)),
                ('run', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='callbacks', to='durable_agents.agentrun')),
            ],
            options={
                'db_table': 'agent_callback',
                'ordering': ['-received_at'],
            },
        ),
    ]
