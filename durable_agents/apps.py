from __future__ import annotations

import sys
import threading
from types import TracebackType

from django.apps import AppConfig
from django.utils.module_loading import autodiscover_modules
from django.utils.translation import gettext_lazy as _

from durable_agents.exceptions import DefinitionError


class DurableAgentsConfig(AppConfig):
    name = "durable_agents"
    verbose_name = _("Durable agents")
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # Imported for what importing them registers: system checks, signal receivers, the
        # services every worker runs besides advancing runs (engine.services), the live
        # page's publisher of streamed text (observers.publish_text).
        from durable_agents import checks, notifications, signals, webhooks  # noqa: F401
        from durable_agents import logging as run_logging
        from durable_agents.batches import fleet  # noqa: F401
        from durable_agents.housekeeping import serving, sweeps  # noqa: F401
        from durable_agents.live import publish  # noqa: F401
        from durable_agents.observe import telemetry
        from durable_agents.schedules import firing  # noqa: F401

        run_logging.install_record_factory()
        telemetry.install()  # the spans, when opentelemetry-api is installed
        signals.intent_waiting.connect(notifications.on_intent_waiting, dispatch_uid="da-intent")
        signals.run_dead_lettered.connect(
            notifications.on_run_dead_lettered, dispatch_uid="da-dead"
        )
        signals.question_asked.connect(notifications.on_question_asked, dispatch_uid="da-question")
        # Webhooks: a receiver writes deliveries only when WEBHOOKS takes the event.
        signals.intent_waiting.connect(webhooks.on_intent_waiting, dispatch_uid="da-hook-intent")
        signals.question_asked.connect(webhooks.on_question_asked, dispatch_uid="da-hook-question")
        signals.run_dead_lettered.connect(
            webhooks.on_run_dead_lettered, dispatch_uid="da-hook-dead"
        )
        signals.run_finished.connect(webhooks.on_run_finished, dispatch_uid="da-hook-finished")
        # Like admin.py: every installed app's agents.py registers its agents on import.
        try:
            autodiscover_modules("agents")
        except DefinitionError as exc:
            print_alone_if_uncaught(exc)
            raise


def print_alone_if_uncaught(error: BaseException) -> None:
    """Should ``error`` end the process (or the thread that re-raises it: ``runserver``'s
    autoreloader), print its message alone instead of a traceback.

    Django lets an error raised while the apps load end ``manage.py`` with the traceback of
    the loading: some thirty lines through ``django.setup`` and importlib whose only useful
    line is the last. A ``DefinitionError`` names the function, its file and line already.
    Whoever catches the error (a test runner, an application server) gets it as it is; every
    other error is printed as before."""
    previous_hook = sys.excepthook
    previous_thread_hook = threading.excepthook

    def hook(
        kind: type[BaseException], value: BaseException, traceback: TracebackType | None
    ) -> None:
        if value is error:
            sys.stderr.write(f"{kind.__name__}: {value}\n")
        else:
            previous_hook(kind, value, traceback)

    def thread_hook(args: threading.ExceptHookArgs) -> None:
        if args.exc_value is error:
            sys.stderr.write(f"{args.exc_type.__name__}: {args.exc_value}\n")
        else:
            previous_thread_hook(args)

    sys.excepthook = hook
    threading.excepthook = thread_hook
