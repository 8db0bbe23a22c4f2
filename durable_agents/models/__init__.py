"""The twenty-one tables of durable_agents, one module per group; every name is importable from
here (``from durable_agents.models import AgentRun``), and migrations name the custom fields
by their path here (``durable_agents.models.JSONTextField``).

    fields      JSONTextField, EncryptedTextField: the custom columns
    ids         new_run_id (time-ordered run ids), short_id, step_part (a run's step partition)
    runs        agent_run: RunStatus, WaitKind, its querysets, the admin's proxy entries
    steps       agent_step: a run's append-only log
    forks       agent_step_share: the steps a fork shares, and steps_of (a run's whole log)
    effects     tool_effect: the effect ledger
    intents     tool_intent: irreversible calls decided by a person
    waits       agent_event, agent_question, agent_callback: what ends a run's wait
    live        agent_progress: what tool code says while it works
    messages    agent_message: a run's inbox, what a user sent while the agent worked
    flow        agent_concurrency_key, model_capacity, capacity_event, agent_usage_day
    schedules   agent_schedule: agents on a clock
    metrics     agent_metrics: snapshots of the operations figures
    workers     agent_worker, agent_version: live workers and the agent versions they define
    webhooks    agent_webhook_delivery: events posted to webhooks, and their attempts
    batches     agent_batch, agent_batch_request: model turns sent through Message Batches

Status changes live in ``store/``, not here."""

from durable_agents.models.batches import (
    AgentBatch,
    AgentBatchRequest,
    BatchStatus,
    RequestStatus,
)
from durable_agents.models.effects import ToolEffect
from durable_agents.models.fields import EncryptedTextField, JSONTextField, StepPartField
from durable_agents.models.flow import (
    USAGE_SHARDS,
    AgentUsageDay,
    CapacityEvent,
    CapacityEventKind,
    ConcurrencyKey,
    ModelCapacity,
)
from durable_agents.models.forks import SharedSteps, steps_of
from durable_agents.models.ids import new_run_id, short_id, step_part, time_of
from durable_agents.models.intents import IntentStatus, ToolIntent, ToolIntentQuerySet
from durable_agents.models.live import AgentProgress
from durable_agents.models.messages import AgentMessage
from durable_agents.models.metrics import MetricsSnapshot
from durable_agents.models.runs import (
    CANCELLABLE_STATUSES,
    CLAIMABLE_STATUSES,
    ENDED_STATUSES,
    FINISHED_STATUSES,
    MAX_CONCURRENCY_KEY,
    MAX_START_KEY,
    AgentRun,
    AgentRunQuerySet,
    DeadLetterEntry,
    OperationsEntry,
    RunStatus,
    WaitKind,
)
from durable_agents.models.schedules import (
    MAX_SCHEDULE_NAME,
    AgentSchedule,
    AgentScheduleQuerySet,
)
from durable_agents.models.steps import STEP_PAYLOAD, AgentStep, StepKind
from durable_agents.models.waits import AgentCallback, AgentEvent, AgentQuestion, QuestionStatus
from durable_agents.models.webhooks import WebhookDelivery, WebhookStatus
from durable_agents.models.workers import (
    MAX_WORKER_ID,
    WORKER_ROWS_KEPT,
    AgentVersion,
    AgentWorker,
    WorkerQuerySet,
)

__all__ = [
    "CANCELLABLE_STATUSES",
    "CLAIMABLE_STATUSES",
    "ENDED_STATUSES",
    "FINISHED_STATUSES",
    "MAX_CONCURRENCY_KEY",
    "MAX_SCHEDULE_NAME",
    "MAX_START_KEY",
    "MAX_WORKER_ID",
    "STEP_PAYLOAD",
    "USAGE_SHARDS",
    "WORKER_ROWS_KEPT",
    "AgentBatch",
    "AgentBatchRequest",
    "AgentCallback",
    "AgentEvent",
    "AgentMessage",
    "AgentProgress",
    "AgentQuestion",
    "AgentRun",
    "AgentRunQuerySet",
    "AgentSchedule",
    "AgentScheduleQuerySet",
    "AgentStep",
    "AgentUsageDay",
    "AgentVersion",
    "AgentWorker",
    "BatchStatus",
    "CapacityEvent",
    "CapacityEventKind",
    "ConcurrencyKey",
    "DeadLetterEntry",
    "EncryptedTextField",
    "IntentStatus",
    "JSONTextField",
    "MetricsSnapshot",
    "ModelCapacity",
    "OperationsEntry",
    "QuestionStatus",
    "RequestStatus",
    "RunStatus",
    "SharedSteps",
    "StepKind",
    "StepPartField",
    "ToolEffect",
    "ToolIntent",
    "ToolIntentQuerySet",
    "WaitKind",
    "WebhookDelivery",
    "WebhookStatus",
    "WorkerQuerySet",
    "new_run_id",
    "short_id",
    "step_part",
    "steps_of",
    "time_of",
]
