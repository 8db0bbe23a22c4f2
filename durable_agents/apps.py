from django.apps import AppConfig
from django.utils.module_loading import autodiscover_modules
from django.utils.translation import gettext_lazy as _


class DurableAgentsConfig(AppConfig):
    name = "durable_agents"
    verbose_name = _("Durable agents")
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # Imported for what importing them registers: system checks, signal receivers.
        from durable_agents import checks, notifications, signals, telemetry  # noqa: F401
        from durable_agents import logging as run_logging

        run_logging.install_record_factory()
        telemetry.install()  # the spans, when opentelemetry-api is installed
        signals.intent_waiting.connect(notifications.on_intent_waiting, dispatch_uid="da-intent")
        signals.run_dead_lettered.connect(
            notifications.on_run_dead_lettered, dispatch_uid="da-dead"
        )
        signals.question_asked.connect(notifications.on_question_asked, dispatch_uid="da-question")
        # Like admin.py: every installed app's agents.py registers its agents on import.
        autodiscover_modules("agents")
