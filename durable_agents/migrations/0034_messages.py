"""``agent_message``: a run's inbox (``send_message``), and a new choice of agent_step.kind
('message'), which changes no column: a new table and no lock on existing ones.
"""

import django.db.models.deletion
import django.db.models.functions.datetime
from django.conf import settings
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('durable_agents', '0033_run_end_notify'),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.AlterField(
            model_name='agentstep',
            name='kind',
            field=models.CharField(choices=[('task', 'Task'), ('model_turn', 'Model turn'), ('tool_result', 'Tool result'), ('message', 'Message')], max_length=16),
        ),
        migrations.CreateModel(
            name='AgentMessage',
            fields=[
                ('id', models.BigAutoField(primary_key=True, serialize=False)),
                ('text', models.TextField()),
                ('key', models.CharField(blank=True, max_length=200, null=True)),
                ('created_at', models.DateTimeField(db_default=django.db.models.functions.datetime.Now(), editable=False)),
                ('folded_at', models.DateTimeField(blank=True, null=True)),
                ('folded_seq', models.IntegerField(blank=True, null=True)),
                ('run', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='messages', to='durable_agents.agentrun')),
                ('sent_by', models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.SET_NULL, related_name='+', to=settings.AUTH_USER_MODEL)),
            ],
            options={
                'db_table': 'agent_message',
                'ordering': ['run_id', 'id'],
                'indexes': [models.Index(condition=models.Q(('folded_seq__isnull', True)), fields=['run'], name='agent_message_waiting')],
                'constraints': [models.UniqueConstraint(condition=models.Q(('key__isnull', False)), fields=('run', 'key'), name='agent_message_run_key')],
            },
        ),
    ]
