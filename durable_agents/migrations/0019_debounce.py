"""Debounced starts: ``waiting_for`` gains the choice "debounce" (a run created waiting for
its start key to be quiet). Choices live in Python only: no SQL, no lock."""

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('durable_agents', '0018_schedule'),
    ]

    operations = [
        migrations.AlterField(
            model_name='agentrun',
            name='waiting_for',
            field=models.CharField(blank=True, choices=[('intent', 'an approval'), ('timer', 'a timer'), ('event', 'an event'), ('runs', 'child runs'), ('question', 'an answer'), ('capacity', 'model capacity'), ('budget', "its key's budget"), ('debounce', 'a quiet window')], db_default='', default='', max_length=16),
        ),
    ]
