"""The durable_agents admin: runs and their transcripts (with what a waiting run waits for, its
parent and children), intents to decide, questions to answer, events to send, schedules, the
dead letter, an operations page, the fleet's workers and agent versions, the webhook
deliveries, and the Message Batches of runs in batches. One module per
screen; this one registers them.

Runs, steps, intents, questions, events, workers and agent versions are never edited by hand:
every page is read-only, and every change of state is an action or a POST view that checks its
permission, calls ``durable_agents.api`` and writes a LogEntry. AgentStep has a composite
primary key and cannot be registered; steps are shown on their run's page. Schedules and
concurrency keys are what people set: their change forms save through the api
(``durable_agents.schedule``, ``set_key_budget``).

Hostile input is expected everywhere: model and tool text is escaped, marked where it cannot be
encoded (``durable_agents._internal.text.storable_text``), its invisible and
direction-changing characters drawn as markers under a warning
(``durable_agents._internal.text.reveal_invisible``, the ``reveal`` template filter) and cut
to a bound with a link to the whole;
malformed ids give 404; a confirmation page acts on exactly the objects it listed.

Every word the admin shows is translatable: labels, titles, filters and actions with
``gettext_lazy``, messages with ``gettext``/``ngettext`` and named placeholders (the catalogue
is ``durable_agents/locale``). What a model, a tool or a person wrote is never translated. The
admin's LogEntry messages stay in English: they are an audit record, written once and read by
whoever comes later, whatever their language.
"""

from django.contrib import admin

from durable_agents.admin.batches import AgentBatchAdmin
from durable_agents.admin.budgets import ConcurrencyKeyAdmin
from durable_agents.admin.entries import DeadLetterEntryAdmin, OperationsEntryAdmin
from durable_agents.admin.events import AgentEventAdmin
from durable_agents.admin.intents import ToolIntentAdmin
from durable_agents.admin.questions import AgentQuestionAdmin
from durable_agents.admin.runs import AgentRunAdmin
from durable_agents.admin.schedules import AgentScheduleAdmin
from durable_agents.admin.webhooks import WebhookDeliveryAdmin
from durable_agents.admin.workers import AgentVersionAdmin, WorkerAdmin
from durable_agents.models import (
    AgentBatch,
    AgentEvent,
    AgentQuestion,
    AgentRun,
    AgentSchedule,
    AgentVersion,
    AgentWorker,
    ConcurrencyKey,
    DeadLetterEntry,
    OperationsEntry,
    ToolIntent,
    WebhookDelivery,
)

admin.site.register(AgentRun, AgentRunAdmin)
admin.site.register(ToolIntent, ToolIntentAdmin)
admin.site.register(AgentQuestion, AgentQuestionAdmin)
admin.site.register(AgentEvent, AgentEventAdmin)
admin.site.register(ConcurrencyKey, ConcurrencyKeyAdmin)
admin.site.register(AgentSchedule, AgentScheduleAdmin)
admin.site.register(AgentWorker, WorkerAdmin)
admin.site.register(AgentVersion, AgentVersionAdmin)
admin.site.register(WebhookDelivery, WebhookDeliveryAdmin)
admin.site.register(AgentBatch, AgentBatchAdmin)

__all__ = [
    "AgentBatchAdmin",
    "AgentEventAdmin",
    "AgentQuestionAdmin",
    "AgentRunAdmin",
    "AgentScheduleAdmin",
    "AgentVersionAdmin",
    "ConcurrencyKeyAdmin",
    "ToolIntentAdmin",
    "WebhookDeliveryAdmin",
    "WorkerAdmin",
]
# Lines of the list of models on /admin/ that lead to the operations and dead-letter pages.
admin.site.register(OperationsEntry, OperationsEntryAdmin)
admin.site.register(DeadLetterEntry, DeadLetterEntryAdmin)
