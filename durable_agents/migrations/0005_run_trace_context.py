from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("durable_agents", "0004_waits"),
    ]

    operations = [
        migrations.AddField(
            model_name="agentrun",
            name="trace_context",
            field=models.TextField(blank=True, editable=False, null=True),
        ),
    ]
