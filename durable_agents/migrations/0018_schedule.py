"""``agent_schedule``: agents on a clock, a row per schedule. A new, empty table: nothing to
backfill, no lock on others."""

import django.db.models.deletion
import django.db.models.functions.datetime
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('durable_agents', '0017_progress'),
    ]

    operations = [
        migrations.CreateModel(
            name='AgentSchedule',
            fields=[
                ('id', models.BigAutoField(primary_key=True, serialize=False)),
                ('name', models.CharField(max_length=150, unique=True)),
                ('agent', models.CharField(max_length=200)),
                ('task', models.TextField()),
                ('cron', models.CharField(blank=True, default='', max_length=200)),
                ('every', models.DurationField(blank=True, null=True)),
                ('timezone', models.CharField(default='UTC', max_length=64)),
                ('priority', models.SmallIntegerField(default=0)),
                ('concurrency_key', models.CharField(blank=True, max_length=200, null=True)),
                ('catch_up', models.BooleanField(default=False)),
                ('enabled', models.BooleanField(default=True)),
                ('next_slot', models.DateTimeField(blank=True, null=True)),
                ('last_slot', models.DateTimeField(blank=True, null=True)),
                ('broken', models.TextField(blank=True, default='')),
                ('created_at', models.DateTimeField(db_default=django.db.models.functions.datetime.Now(), editable=False)),
                ('updated_at', models.DateTimeField(db_default=django.db.models.functions.datetime.Now(), editable=False)),
                ('last_run', models.ForeignKey(blank=True, db_constraint=False, null=True, on_delete=django.db.models.deletion.SET_NULL, related_name='+', to='durable_agents.agentrun')),
            ],
            options={
                'verbose_name': 'agent schedule',
                'db_table': 'agent_schedule',
                'ordering': ['name'],
                'permissions': [('run_agentschedule', "Can start a schedule's run now")],
                'indexes': [models.Index(condition=models.Q(('broken', ''), ('enabled', True)), fields=['next_slot'], name='agent_schedule_due')],
                'constraints': [models.CheckConstraint(condition=models.Q(models.Q(('cron', ''), ('every__isnull', False)), models.Q(models.Q(('cron', ''), _negated=True), ('every__isnull', True)), _connector='OR'), name='agent_schedule_cron_or_every')],
            },
        ),
    ]
