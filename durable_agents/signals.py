"""Signals a host project can connect to (notifications, metrics, audit)."""

from django.dispatch import Signal

# sender=ToolIntent, intent=<ToolIntent>: an irreversible call waits for a person
# (status pending, or unknown after a crash while it ran).
intent_waiting = Signal()

# sender=AgentRun, run_id=<uuid>, reason=<str>: a run went to the dead letter.
run_dead_lettered = Signal()

# sender=AgentRun, run_id=<uuid>, status=<str>: a run reached succeeded, failed or cancelled.
run_finished = Signal()
