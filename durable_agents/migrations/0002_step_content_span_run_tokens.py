"""Content spans on model turns (a resume sends the stored content text without parsing it)
and the run's token count (a token budget reads one column instead of the whole log).

Turns committed before this migration have no span: they are rebuilt by parsing them, as
before. Runs that can still take steps get their token count from the usage of their turns."""

import json

from django.db import migrations, models

USAGE_KEYS = (
    "input_tokens",
    "cache_creation_input_tokens",
    "cache_read_input_tokens",
    "output_tokens",
)


def count_tokens_of_open_runs(apps, schema_editor):
    AgentRun = apps.get_model("durable_agents", "AgentRun")
    AgentStep = apps.get_model("durable_agents", "AgentStep")
    open_runs = AgentRun.objects.filter(status__in=["pending", "running", "waiting", "dead"])
    for run_id in open_runs.values_list("pk", flat=True).iterator():
        total = 0
        payloads = AgentStep.objects.filter(run_id=run_id, kind="model_turn").values_list(
            "payload", flat=True
        )
        for payload in payloads.iterator():
            try:
                usage = json.loads(payload).get("usage") or {}
                total += sum(int(usage.get(key) or 0) for key in USAGE_KEYS)
            except (ValueError, TypeError, AttributeError):
                continue
        if total:
            AgentRun.objects.filter(pk=run_id).update(tokens_used=total)


class Migration(migrations.Migration):
    dependencies = [
        ("durable_agents", "0001_initial"),
    ]

    operations = [
        migrations.AddField(
            model_name="agentrun",
            name="tokens_used",
            field=models.BigIntegerField(
                db_default=0,
                default=0,
                help_text="input, cache and output tokens of its turns so far",
            ),
        ),
        migrations.AddField(
            model_name="agentstep",
            name="content_end",
            field=models.IntegerField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name="agentstep",
            name="content_start",
            field=models.IntegerField(blank=True, null=True),
        ),
        migrations.RunPython(
            count_tokens_of_open_runs, migrations.RunPython.noop, elidable=True
        ),
    ]
