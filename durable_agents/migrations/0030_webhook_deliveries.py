"""agent_webhook_delivery: each event posted to a webhook of WEBHOOKS, its attempts and its
outcome, with a partial index on the pending deliveries' next attempt (housekeeping's look for
due retries) and one on their creation (the admin's list, and pruning after WEBHOOK_KEEP_DAYS).
A new table: no lock on existing ones.
"""

import django.db.models.functions.datetime
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('durable_agents', '0029_run_metadata'),
    ]

    operations = [
        migrations.CreateModel(
            name='WebhookDelivery',
            fields=[
                ('id', models.BigAutoField(primary_key=True, serialize=False)),
                ('url', models.TextField()),
                ('event', models.CharField(max_length=32)),
                ('run_id', models.UUIDField(blank=True, null=True)),
                ('payload', models.JSONField()),
                ('status', models.CharField(choices=[('pending', 'Pending'), ('delivered', 'Delivered'), ('failed', 'Failed')], default='pending', max_length=16)),
                ('attempts', models.PositiveIntegerField(default=0)),
                ('next_attempt_at', models.DateTimeField(blank=True, null=True)),
                ('last_error', models.TextField(blank=True, default='')),
                ('response_status', models.PositiveSmallIntegerField(blank=True, null=True)),
                ('created_at', models.DateTimeField(db_default=django.db.models.functions.datetime.Now(), editable=False)),
                ('delivered_at', models.DateTimeField(blank=True, null=True)),
            ],
            options={
                'verbose_name': 'webhook delivery',
                'verbose_name_plural': 'webhook deliveries',
                'db_table': 'agent_webhook_delivery',
                'ordering': ['-created_at', '-id'],
                'permissions': [('retry_webhookdelivery', 'Can send webhook deliveries again')],
                'indexes': [
                    models.Index(condition=models.Q(('status', 'pending')), fields=['next_attempt_at'], name='agent_webhook_due'),
                    models.Index(fields=['created_at'], name='agent_webhook_created'),
                ],
            },
        ),
    ]
