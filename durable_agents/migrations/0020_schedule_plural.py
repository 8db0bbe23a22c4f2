"""agent_schedule's plural name in the admin ("agent schedules"): model options only, no SQL."""

from django.db import migrations


class Migration(migrations.Migration):

    dependencies = [
        ('durable_agents', '0019_debounce'),
    ]

    operations = [
        migrations.AlterModelOptions(
            name='agentschedule',
            options={'ordering': ['name'], 'permissions': [('run_agentschedule', "Can start a schedule's run now")], 'verbose_name': 'agent schedule', 'verbose_name_plural': 'agent schedules'},
        ),
    ]
