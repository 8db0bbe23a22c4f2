# Two proxy models, no table and no SQL: the operations and dead-letter pages' lines in the
# admin's list of models (which lists registered models only).

from django.db import migrations


def _entry(name: str, verbose_name: str) -> migrations.CreateModel:
    return migrations.CreateModel(
        name=name,
        fields=[],
        options={
            "verbose_name": verbose_name,
            "verbose_name_plural": verbose_name,
            "proxy": True,
            "default_permissions": (),
            "indexes": [],
            "constraints": [],
        },
        bases=("durable_agents.agentrun",),
    )


class Migration(migrations.Migration):
    dependencies = [
        ("durable_agents", "0014_run_root"),
    ]

    operations = [
        _entry("DeadLetterEntry", "Dead letter"),
        _entry("OperationsEntry", "Operations"),
    ]
