"""A concurrency key's limit and budget as staff set them in the admin:
``agent_concurrency_key.concurrency_limit`` (NULL: CONCURRENCY_LIMITS and the agents decide)
and ``agent_concurrency_key.usd_per_day`` (NULL: the BUDGETS setting decides). Nullable
columns without a default on a small table: PostgreSQL changes its catalogue only.
``waiting_for`` gains the choice "budget" (Python only: no SQL).
"""

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('durable_agents', '0012_concurrency_keys'),
    ]

    operations = [
        migrations.AddField(
            model_name='concurrencykey',
            name='concurrency_limit',
            field=models.PositiveIntegerField(blank=True, help_text='runs of the key running at once; empty: CONCURRENCY_LIMITS and the agents decide', null=True),
        ),
        migrations.AddField(
            model_name='concurrencykey',
            name='usd_per_day',
            field=models.DecimalField(blank=True, decimal_places=4, help_text='USD per UTC day; empty: the BUDGETS setting decides', max_digits=14, null=True),
        ),
        migrations.AlterField(
            model_name='agentrun',
            name='waiting_for',
            field=models.CharField(blank=True, choices=[('intent', 'an approval'), ('timer', 'a timer'), ('event', 'an event'), ('runs', 'child runs'), ('question', 'an answer'), ('capacity', 'model capacity'), ('budget', "its key's budget")], db_default='', default='', max_length=16),
        ),
    ]
