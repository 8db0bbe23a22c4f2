"""The registered agents and their tools: a non-idempotent tool without an idempotency key
(E010), context edits without their beta (W004), an irreversible tool whose calls may outlast
the shutdown grace (W008). ``check_agents`` also says which models named by flow control no
agent uses."""

from __future__ import annotations

from typing import Any

from django.core.checks import CheckMessage, Error, Warning, register

from durable_agents.checks.flow import rate_limits_for_unknown_models, unused_prices
from durable_agents.checks.values import in_bounds
from durable_agents.conf import app_settings


@register()
def check_agents(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """Each registered agent's tools and context edits, then the models that RATE_LIMITS
    and PRICES name and no agent uses."""
    from durable_agents.declare.agents import registry

    messages: list[CheckMessage] = []
    for agent in registry.all():
        for tool in agent.tools:
            if tool.effect == "non_idempotent" and not tool.takes_idempotency_key:
                messages.append(
                    Error(
                        f"Tool {tool.name!r} of agent {agent.name}@{agent.version} is "
                        "non_idempotent but takes no idempotency_key parameter.",
                        hint="Add a keyword parameter `idempotency_key: str` and pass it to the "
                        "system the tool writes to, so that a retried call is deduplicated; "
                        "or classify the tool correctly.",
                        obj=_dotted_path(tool.func),
                        id="durable_agents.E010",
                    )
                )
        missing = _missing_betas(agent, app_settings.BETAS)
        if missing:
            messages.append(
                Warning(
                    f"Agent {agent.name}@{agent.version} configures context_management edits "
                    f"({', '.join(missing)}) without their beta.",
                    hint="Add "
                    + " and ".join(repr(EDIT_BETAS[edit]) for edit in missing)
                    + " to Agent(betas=[...]) (or to the BETAS setting): without it every "
                    "call is refused with a 400 and the run goes to the dead letter.",
                    obj=agent.label,
                    id="durable_agents.W004",
                )
            )
    return [
        *messages,
        *rate_limits_for_unknown_models({a.model for a in registry.all()}),
        *unused_prices(registry.all()),
    ]


IRREVERSIBLE_OUTLASTS_GRACE = "durable_agents.W008"


@register()
def check_shutdown_grace(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """An irreversible tool whose calls may outlast the shutdown grace: a worker stopped while
    one runs (Ctrl-C, a deploy's SIGTERM) abandons it when the grace ends, and its intent's
    outcome becomes unknown, for a person to find out and resolve. One warning per tool, at
    the longest timeout any agent gives it."""
    from durable_agents.declare.agents import registry
    from durable_agents.declare.tools import EffectClass

    grace, ceiling = app_settings.SHUTDOWN_GRACE_SECONDS, app_settings.TOOL_TIMEOUT
    if not all(in_bounds(v, False, 0, True) for v in (grace, ceiling)):
        return []  # E003 says what is wrong with them
    # Tool function -> (its name, the longest timeout, the agents that give it one too long).
    longest: dict[Any, tuple[str, float, list[str]]] = {}
    for agent in registry.all():
        for tool in agent.tools:
            if tool.effect is not EffectClass.IRREVERSIBLE:
                continue
            timeout = agent.timeout_for(tool, float(ceiling))
            if timeout <= grace:
                continue
            _, known, agents = longest.get(tool.func, (tool.name, 0.0, []))
            longest[tool.func] = (tool.name, max(known, timeout), [*agents, agent.label])
    messages: list[CheckMessage] = []
    for func, (name, timeout, agents) in longest.items():
        messages.append(
            Warning(
                f"The irreversible tool {name!r} (of {', '.join(agents)}) may run for "
                f"{timeout:g}s, its timeout, longer than SHUTDOWN_GRACE_SECONDS ({grace:g}s): "
                "a worker stopped while it runs (Ctrl-C, a deploy's SIGTERM) abandons the call "
                "when the grace ends, and a person must then find out whether it took effect.",
                hint=f"If its calls are quicker than that, give the tool a timeout within the "
                f"grace: @tool(effect='irreversible', timeout={grace:g}). Else raise "
                f"SHUTDOWN_GRACE_SECONDS (or runagents --grace-seconds) to at least {timeout:g}, "
                "and the time your supervisor allows between SIGTERM and SIGKILL with it "
                "(Kubernetes terminationGracePeriodSeconds, systemd TimeoutStopSec).",
                obj=_dotted_path(func),
                id=IRREVERSIBLE_OUTLASTS_GRACE,
            )
        )
    return messages


# The anthropic-beta each server-side context edit needs: the API refuses the edit without it.
EDIT_BETAS = {
    "compact_20260112": "compact-2026-01-12",
    "clear_tool_uses_20250919": "context-management-2025-06-27",
    "clear_thinking_20251015": "context-management-2025-06-27",
}


def _missing_betas(agent: Any, global_betas: Any) -> list[str]:
    """The context_management edits of ``agent`` whose beta is in neither its betas nor
    ``global_betas``."""
    management = agent.params.get("context_management")
    edits = management.get("edits") if isinstance(management, dict) else None
    if not isinstance(edits, list):
        return []
    sent = set(agent.betas) | set(global_betas or ())
    missing = []
    for edit in edits:
        kind = edit.get("type") if isinstance(edit, dict) else None
        if kind in EDIT_BETAS and EDIT_BETAS[kind] not in sent and kind not in missing:
            missing.append(kind)
    return missing


def _dotted_path(func: Any) -> str:
    """``module.qualname`` of a function: the check message names it where the default
    ``str()`` would print ``<function ... at 0x...>``."""
    module = getattr(func, "__module__", None)
    qualname = getattr(func, "__qualname__", None) or getattr(func, "__name__", None)
    if not qualname:
        return repr(func)
    return f"{module}.{qualname}" if module else qualname
