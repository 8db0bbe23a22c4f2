"""The fleet in the database: agent_worker (a row per live worker, kept current by its
heartbeat) and agent_version (when each agent version was last defined by a live worker, and
digests of what it sent). Two new tables and a new choice of agent_run.waiting_for ('worker':
a pending run no live worker can serve), which changes no column: no lock on existing tables.
"""

import django.db.models.functions.datetime
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('durable_agents', '0026_run_id_tail'),
    ]

    operations = [
        migrations.CreateModel(
            name='AgentWorker',
            fields=[
                ('id', models.CharField(max_length=200, primary_key=True, serialize=False)),
                ('instance', models.UUIDField()),
                ('host', models.CharField(max_length=255)),
                ('pid', models.IntegerField()),
                ('started_at', models.DateTimeField(db_default=django.db.models.functions.datetime.Now())),
                ('beat_at', models.DateTimeField(db_default=django.db.models.functions.datetime.Now())),
                ('alive_until', models.DateTimeField(db_index=True)),
                ('concurrency', models.IntegerField()),
                ('runs_held', models.IntegerField(default=0)),
                ('draining', models.BooleanField(default=False)),
                ('versions', models.JSONField(default=list)),
            ],
            options={
                'verbose_name': 'worker',
                'verbose_name_plural': 'workers',
                'db_table': 'agent_worker',
                'ordering': ['id'],
            },
        ),
        migrations.AlterField(
            model_name='agentrun',
            name='waiting_for',
            field=models.CharField(blank=True, choices=[('intent', 'an approval'), ('timer', 'a timer'), ('event', 'an event'), ('runs', 'child runs'), ('question', 'an answer'), ('capacity', 'model capacity'), ('budget', "its key's budget"), ('debounce', 'a quiet window'), ('worker', 'a worker that defines its version')], db_default='', default='', max_length=16),
        ),
        migrations.CreateModel(
            name='AgentVersion',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('agent', models.CharField(max_length=200)),
                ('version', models.CharField(max_length=200)),
                ('fingerprint', models.CharField(max_length=64)),
                ('model', models.CharField(max_length=200)),
                ('binding', models.CharField(max_length=64)),
                ('tools', models.JSONField(default=dict)),
                ('first_defined_at', models.DateTimeField(db_default=django.db.models.functions.datetime.Now())),
                ('last_defined_at', models.DateTimeField(db_default=django.db.models.functions.datetime.Now())),
            ],
            options={
                'verbose_name': 'agent version',
                'verbose_name_plural': 'agent versions',
                'db_table': 'agent_version',
                'ordering': ['agent', 'version', '-last_defined_at'],
                'constraints': [models.UniqueConstraint(fields=('agent', 'version', 'fingerprint'), name='agent_version_definition')],
            },
        ),
    ]
