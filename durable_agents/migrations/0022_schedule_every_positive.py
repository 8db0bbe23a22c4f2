"""agent_schedule.every is positive (a CHECK constraint).

A row with every <= 0 (written by hand: ``schedule()`` refuses one) made each firing divide by
zero, or moved its next slot backwards so that it was due again at once. An install may hold
such a row already, so the rows are fixed before the constraint is added, or adding it would
fail: each is marked broken (it fires nothing until someone gives it a timing, with
``schedule()`` or on its admin page), its reason says what its interval was, and its interval
becomes 366 days, the longest ``schedule()`` accepts, so that a row saved again as it is
cannot flood. The table holds one row per schedule: the CHECK's scan is short."""

import datetime

from django.db import migrations, models

LONGEST = datetime.timedelta(days=366)


def break_bad_intervals(apps, schema_editor):
    AgentSchedule = apps.get_model('durable_agents', 'AgentSchedule')
    for row in AgentSchedule.objects.filter(every__lte=datetime.timedelta(0)):
        row.broken = (
            f'its interval (every) was {row.every}, not positive; set to {LONGEST.days} days '
            'until its timing is given again'
        )
        row.every = LONGEST
        row.save(update_fields=['broken', 'every'])


class Migration(migrations.Migration):

    dependencies = [
        ('durable_agents', '0021_fork_key_run'),
    ]

    operations = [
        migrations.RunPython(break_bad_intervals, migrations.RunPython.noop, elidable=True),
        migrations.AddConstraint(
            model_name='agentschedule',
            constraint=models.CheckConstraint(
                condition=models.Q(('every__isnull', True), ('every__gt', datetime.timedelta(0)), _connector='OR'),
                name='agent_schedule_every_positive',
            ),
        ),
    ]
