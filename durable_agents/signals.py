"""Signals a host project can connect to (notifications, metrics, audit)."""

from django.dispatch import Signal

# sender=ToolIntent, intent=<ToolIntent>: an irreversible call waits for a person
# (status pending, or unknown after a crash while it ran).
intent_waiting = Signal()

# sender=AgentRun, run_id=<uuid>, reason=<str>: a run went to the dead letter.
run_dead_lettered = Signal()

# sender=AgentRun, run_id=<uuid>, status=<str>: a run reached succeeded, failed or cancelled.
run_finished = Signal()

# sender=AgentRun, run_id=<uuid>, waiting_for=<WaitKind>, what=<str>: a run parked on a timer,
# an event, child runs or a question (intents also send intent_waiting).
run_waiting = Signal()

# sender=AgentQuestion, question=<AgentQuestion>: a run asked a person (ask_person).
question_asked = Signal()

# sender=AgentQuestion, question=<AgentQuestion>: a person answered it.
question_answered = Signal()

# sender=AgentEvent, event=<AgentEvent>, woken=<int>: send_event stored an event and woke runs.
event_sent = Signal()

# sender=AgentRun, run_id=<uuid>, agent=<str>, from_version=<str>, to_version=<str>,
# carried_over=<bool>, user=<the user who asked, or None from code>: a run was moved to another
# version of its agent (upgrade_runs; carry_over_runs for a dead run, carried_over=True).
run_upgraded = Signal()
