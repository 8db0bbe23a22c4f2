"""Model capacity: the fleet's rate-limit buckets (``model_capacity``) and the record of 429s,
529s and pauses (``capacity_event``).

Two new tables, created empty: nothing existing is locked or rewritten, and workers of the
previous release (which never read them) go on meanwhile. ``waiting_for`` gains the choice
"capacity" (a pending run waiting for a model's capacity); choices live in Python only, so
that change emits no SQL.
"""

import django.utils.timezone
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('durable_agents', '0009_run_priority'),
    ]

    operations = [
        migrations.CreateModel(
            name='ModelCapacity',
            fields=[
                ('model', models.CharField(max_length=200, primary_key=True, serialize=False)),
                ('configured', models.BooleanField(default=False)),
                ('probing', models.BooleanField(default=False)),
                ('requests_per_minute', models.FloatField(blank=True, null=True)),
                ('input_tokens_per_minute', models.FloatField(blank=True, null=True)),
                ('output_tokens_per_minute', models.FloatField(blank=True, null=True)),
                ('burst_seconds', models.FloatField(default=10.0)),
                ('requests_level', models.FloatField(default=0.0)),
                ('input_level', models.FloatField(default=0.0)),
                ('output_level', models.FloatField(default=0.0)),
                ('refilled_at', models.DateTimeField(default=django.utils.timezone.now)),
                ('paused_until', models.DateTimeField(blank=True, null=True)),
                ('waiting_priority', models.SmallIntegerField(blank=True, null=True)),
                ('waiting_priority_until', models.DateTimeField(blank=True, null=True)),
                ('input_per_call', models.FloatField(default=0.0)),
                ('output_per_call', models.FloatField(default=0.0)),
                ('calls', models.BigIntegerField(default=0)),
                ('rate_limited', models.BigIntegerField(default=0, help_text='429 answers')),
                ('pauses', models.BigIntegerField(default=0)),
                ('capacity_waits', models.BigIntegerField(default=0, help_text='runs handed back to wait for capacity')),
                ('updated_at', models.DateTimeField(default=django.utils.timezone.now)),
            ],
            options={
                'verbose_name_plural': 'model capacity',
                'db_table': 'model_capacity',
            },
        ),
        migrations.AlterField(
            model_name='agentrun',
            name='waiting_for',
            field=models.CharField(blank=True, choices=[('intent', 'an approval'), ('timer', 'a timer'), ('event', 'an event'), ('runs', 'child runs'), ('question', 'an answer'), ('capacity', 'model capacity')], db_default='', default='', max_length=16),
        ),
        migrations.CreateModel(
            name='CapacityEvent',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('model', models.CharField(max_length=200)),
                ('kind', models.CharField(choices=[('rate_limited', '429 rate limited'), ('overloaded', '529 overloaded'), ('paused', 'paused')], max_length=16)),
                ('at', models.DateTimeField(default=django.utils.timezone.now)),
                ('seconds', models.FloatField(blank=True, null=True)),
            ],
            options={
                'db_table': 'capacity_event',
                'indexes': [models.Index(fields=['at'], name='capacity_event_at')],
            },
        ),
    ]
