"""Agents: a named, versioned Messages API configuration, and the registry that finds them.

A run pins ``name``, ``version``, ``model`` and the fingerprint of the request parameters when
it starts; a worker that resumes it looks the agent up again by name and version and checks the
fingerprint, so two processes never disagree silently about what the model was shown.

The fingerprint covers everything an agent sends besides the messages: the request body's
parameters (``request_params``: model, system, tools, thinking, ``params`` such as
``context_management``, the top-level ``cache_control`` of ``cache=True`` and the
``output_config.format`` of ``output_schema``) and the agent's own
``anthropic-beta`` values (``betas``). Changing any of them without a new version is prompt drift.

This module never touches the database: agents are built at import of an app's ``agents.py``.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import threading
from collections.abc import Callable, Iterable
from typing import Any

from django.core.exceptions import ImproperlyConfigured

from durable_agents.declare.output import OutputSchema
from durable_agents.declare.tools import Tool
from durable_agents.exceptions import AgentNotFound

__all__ = ["Agent", "AgentNotFound", "AgentRegistry", "get_agent", "registry"]

# Keys that Agent sets itself; letting ``params`` carry them would make two sources of truth.
# ``betas`` is not a body parameter at all: it names the agent's anthropic-beta header values
# (``Agent(betas=...)``), carried in the request parameters under this key and sent as the
# header by ``llm.create_turn``, which leaves the key out of the body.
RESERVED_PARAMS = (
    "messages",
    "model",
    "system",
    "tools",
    "max_tokens",
    "thinking",
    "stream",
    "betas",
)

# Automatic prompt caching (``Agent(cache=True)``): one top-level marker, which the server
# moves to the last cacheable block of each request. The thinking-signature check allows it.
AUTOMATIC_CACHE_CONTROL: dict[str, Any] = {"type": "ephemeral"}

# The AgentRun columns that store name, version and model are this long.
_MAX_LABEL_CHARS = 200


def _check_batch(where: str, batch: bool, stream: bool) -> None:
    if batch and stream:
        raise ImproperlyConfigured(
            f"{where}: batch=True and stream=True exclude each other: a turn sent through "
            "Message Batches arrives whole, hours later, and cannot stream (start its runs "
            "with start_run(..., batch=True) instead, and keep the agent streaming)"
        )


def _canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


class Agent:
    """A versioned agent: model, system prompt, tools and the other request parameters.

    ``output_schema``: a JSON Schema the final answer must match. It is sent with every
    request as structured outputs (``output_config.format``), so it is part of the
    fingerprint; the answer is parsed and validated, an invalid one is told to the model,
    which answers again within ``max_turns``, and the valid one is the run's ``output``.
    """

    def __init__(
        self,
        *,
        name: str,
        version: str,
        model: str,
        system: str | list[dict[str, Any]] = "",
        tools: Iterable[Tool] = (),
        max_tokens: int = 4096,
        thinking: dict[str, Any] | None = None,
        params: dict[str, Any] | None = None,
        max_turns: int = 50,
        max_total_tokens: int | None = None,
        max_wall_seconds: float | None = None,
        stream: bool = False,
        batch: bool = False,
        on_text: Callable[[Any, str], None] | None = None,
        tool_timeout: float | None = None,
        betas: list[str] | tuple[str, ...] = (),
        cache: bool = False,
        concurrency_limit: int | None = None,
        upgrades_from: Iterable[str] = (),
        output_schema: dict[str, Any] | None = None,
        register: bool = True,
    ) -> None:
        _check_labels(name=name, version=version, model=model)
        where = f"agent {name}@{version}"
        _check_limits(
            where,
            system=system,
            max_tokens=max_tokens,
            max_turns=max_turns,
            optional={
                "max_total_tokens": max_total_tokens,
                "max_wall_seconds": max_wall_seconds,
                "tool_timeout": tool_timeout,
            },
        )
        _check_options(where, concurrency_limit, on_text, batch, stream)
        _check_thinking(where, thinking, max_tokens)
        params = _checked_params(where, params, cache)
        output = _checked_output(where, params, output_schema)
        betas = _checked_betas(where, betas)
        tools_by_name = _tools_by_name(where, tools)

        self.name = name
        self.version = version
        self.model = model
        # Private copies: the fingerprint must not drift because a caller mutated a dict later.
        self.system = copy.deepcopy(system)
        # In the order given (names are unique, so none was dropped).
        self.tools: tuple[Tool, ...] = tuple(tools_by_name.values())
        self.tools_by_name = tools_by_name
        self.max_tokens = max_tokens
        self.thinking = copy.deepcopy(thinking)
        self.params = copy.deepcopy(params)
        # anthropic-beta values of this agent's calls, sent after the global BETAS setting.
        self.betas: tuple[str, ...] = betas
        self.cache = cache
        self.max_turns = max_turns
        # The JSON Schema of the final answer (None: a text answer only). Sent with every
        # request as ``output_config.format``, so it is part of the fingerprint.
        self.output: OutputSchema | None = output
        self._fingerprints: dict[str, str] = {}
        self._requests: dict[str, dict[str, Any]] = {}
        self._digests: dict[str, Any] | None = None
        self._keep_run_options(
            max_total_tokens=max_total_tokens,
            max_wall_seconds=max_wall_seconds,
            stream=stream,
            batch=batch,
            on_text=on_text,
            tool_timeout=tool_timeout,
            concurrency_limit=concurrency_limit,
            upgrades_from=_checked_upgrades(where, version, upgrades_from),
        )
        self._check_serialisable(where)
        if register:
            registry.register(self)

    def _keep_run_options(
        self,
        *,
        max_total_tokens: int | None,
        max_wall_seconds: float | None,
        stream: bool,
        batch: bool,
        on_text: Callable[[Any, str], None] | None,
        tool_timeout: float | None,
        concurrency_limit: int | None,
        upgrades_from: tuple[str, ...],
    ) -> None:
        """What the worker uses around the requests, not in them: left out of the
        fingerprint."""
        # Budgets and delivery are checked or used by the worker between and during steps.
        self.max_total_tokens = max_total_tokens
        self.max_wall_seconds = max_wall_seconds
        self.stream = bool(stream)
        # Its runs' model turns go through Message Batches (start_run(..., batch=) overrides
        # it per run). The requests are the same either way: not part of the fingerprint.
        self.batch = bool(batch)
        self.on_text = on_text
        # Seconds a call of one of its tools may take when the tool sets no timeout of its
        # own; TOOL_TIMEOUT caps both (see ``timeout_for``).
        self.tool_timeout = tool_timeout
        # At most this many of its runs with one concurrency key run at once, fleet-wide
        # (CONCURRENCY_LIMITS[key] overrides it); pinned on each run when it starts. Not part
        # of the request: left out of the fingerprint.
        self.concurrency_limit = concurrency_limit
        # Versions whose runs a worker of this code moves to this one (``upgrade_runs``) when
        # no live worker defines theirs, where their history allows it. Not part of the
        # request: left out of the fingerprint.
        self.upgrades_from: tuple[str, ...] = upgrades_from

    def _check_serialisable(self, where: str) -> None:
        """The fingerprint is the canonical JSON of the request: it must be computable now,
        not on the first run's first call."""
        try:
            self.fingerprint()
        except (TypeError, ValueError) as exc:
            raise ImproperlyConfigured(
                f"{where}: the request parameters are not JSON-serialisable: {exc}"
            ) from exc

    @property
    def output_schema(self) -> dict[str, Any] | None:
        """The JSON Schema the final answer must match, or None (a copy)."""
        return None if self.output is None else copy.deepcopy(self.output.schema)

    @property
    def label(self) -> str:
        """``name@version``, as runs and messages show it."""
        return f"{self.name}@{self.version}"

    def request_params(self, model: str | None = None) -> dict[str, Any]:
        """Everything sent on a Messages API call except ``messages``, in a fixed key order.

        With ``betas``, the last key is ``"betas"``: the agent's anthropic-beta values, as the
        SDK's ``betas=`` argument takes them. ``llm.create_turn`` sends them as a header,
        never in the body; an agent without betas has no such key, so its request and
        fingerprint are exactly what they were before betas existed."""
        out: dict[str, Any] = {"model": model or self.model, "max_tokens": self.max_tokens}
        # An empty system prompt is left out rather than sent as "".
        if self.system:
            out["system"] = copy.deepcopy(self.system)
        if self.tools:
            out["tools"] = [t.definition() for t in self.tools]
        if self.thinking is not None:
            out["thinking"] = copy.deepcopy(self.thinking)
        if self.cache:
            out["cache_control"] = copy.deepcopy(AUTOMATIC_CACHE_CONTROL)
        out.update(copy.deepcopy(self.params))
        if self.output is not None:
            # Merged into an ``output_config`` of ``params`` (its ``effort``), else added: an
            # agent without an output schema sends exactly what it sent before they existed.
            config = out.get("output_config") or {}
            out["output_config"] = {**config, "format": self.output.request_format()}
        if self.betas:
            out["betas"] = list(self.betas)
        return out

    def request_for(self, model: str | None = None) -> dict[str, Any]:
        """``request_params(model)``, built once per model and shared: the worker reads it on
        every claim and never changes it. Callers must not mutate it either."""
        key = model or self.model
        cached = self._requests.get(key)
        if cached is None:
            cached = self._requests[key] = self.request_params(key)
        return cached

    def fingerprint(self, model: str | None = None) -> str:
        """sha256 of the canonical JSON of ``request_params(model)`` (so of the agent's betas
        and its cache setting too: both change what is sent). Memoised per model: an
        agent's definition is a private copy that nothing changes after construction, and
        the worker checks the fingerprint on every claim."""
        key = model or self.model
        cached = self._fingerprints.get(key)
        if cached is None:
            canonical = _canonical_json(self.request_params(key))
            cached = self._fingerprints[key] = hashlib.sha256(canonical.encode()).hexdigest()
        return cached

    def digests(self) -> dict[str, Any]:
        """What ``agent_version`` records of this definition: the fingerprint (for the
        agent's model), ``binding`` (sha256 of the system prompt and tools, which signed
        thinking binds besides the model) and ``tools`` ({name: sha256 of its effect class and
        input schema}), so that a version no deployed code defines can still be compared."""
        if self._digests is None:
            request = self.request_for()
            binding = {p: request.get(p) for p in ("system", "tools")}
            self._digests = {
                "fingerprint": self.fingerprint(),
                "model": self.model,
                "binding": _sha256(binding),
                "tools": {
                    tool.name: _sha256({"effect": str(tool.effect), "schema": tool.input_schema})
                    for tool in self.tools
                },
            }
        return self._digests

    def timeout_for(self, tool: Tool, ceiling: float) -> float:
        """Seconds one call of ``tool`` may take: its own timeout, else the agent's, else the
        ``ceiling`` (the TOOL_TIMEOUT setting), and never more than the ceiling."""
        own = tool.timeout if tool.timeout is not None else self.tool_timeout
        return ceiling if own is None else min(float(own), ceiling)

    def __repr__(self) -> str:
        return f"<Agent {self.label} model={self.model} tools={len(self.tools)}>"


def _sha256(value: Any) -> str:
    return hashlib.sha256(_canonical_json(value).encode()).hexdigest()


def _checked_upgrades(where: str, version: str, upgrades_from: Any) -> tuple[str, ...]:
    """``upgrades_from``: other versions of the agent, as strings."""
    if isinstance(upgrades_from, str):
        raise ImproperlyConfigured(
            f"{where}: upgrades_from is a list of versions, not the string {upgrades_from!r}"
        )
    try:
        versions = tuple(upgrades_from)
    except TypeError:
        raise ImproperlyConfigured(
            f"{where}: upgrades_from is a list of versions, not {type(upgrades_from).__name__}"
        ) from None
    for old in versions:
        if not isinstance(old, str) or not old.strip() or len(old) > _MAX_LABEL_CHARS:
            raise ImproperlyConfigured(
                f"{where}: upgrades_from holds versions (non-empty strings), not {old!r}"
            )
        if old == version:
            raise ImproperlyConfigured(f"{where}: a version cannot upgrade from itself")
    return tuple(dict.fromkeys(versions))


def _check_labels(**labels: Any) -> None:
    """Name, version and model: non-empty strings that fit their columns."""
    for label, value in labels.items():
        if not isinstance(value, str) or not value.strip():
            raise ImproperlyConfigured(f"Agent {label} must be a non-empty string, got {value!r}")
        if len(value) > _MAX_LABEL_CHARS:
            raise ImproperlyConfigured(
                f"Agent {label} {value[:40]!r}... is longer than {_MAX_LABEL_CHARS} characters"
            )
        if not value.isprintable():
            # Claims match a run's agent and version joined by a control character.
            raise ImproperlyConfigured(f"Agent {label} {value[:40]!r} contains control characters")


def _is_positive_int(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value >= 1


def _check_limits(
    where: str, *, system: Any, max_tokens: Any, max_turns: Any, optional: dict[str, Any]
) -> None:
    """The system prompt's shape, and the numbers that bound a call and a run (``optional``:
    limits that may be None, else must be positive numbers)."""
    if not isinstance(system, str | list):
        raise ImproperlyConfigured(
            f"{where}: system must be a string or a list of text blocks, got {system!r}"
        )
    if not _is_positive_int(max_tokens):
        raise ImproperlyConfigured(
            f"{where}: max_tokens must be a positive integer, got {max_tokens!r}"
        )
    if not _is_positive_int(max_turns):
        raise ImproperlyConfigured(f"{where}: max_turns must be at least 1, got {max_turns!r}")
    for label, limit in optional.items():
        if limit is not None and (
            isinstance(limit, bool) or not isinstance(limit, int | float) or limit <= 0
        ):
            raise ImproperlyConfigured(f"{where}: {label} must be positive, got {limit!r}")


def _check_concurrency_limit(where: str, limit: Any) -> None:
    """None, or a whole number >= 1 (a pause is ``CONCURRENCY_LIMITS[key] = 0``, per key)."""
    if limit is None:
        return
    if isinstance(limit, bool) or not isinstance(limit, int):
        raise ValueError(f"{where}: concurrency_limit must be an int or None, got {limit!r}")
    if limit < 1:
        raise ValueError(
            f"{where}: concurrency_limit must be at least 1, got {limit}; to hold a key's "
            "runs, set DURABLE_AGENTS['CONCURRENCY_LIMITS'][key] = 0"
        )


def _check_options(
    where: str, concurrency_limit: Any, on_text: Any, batch: bool, stream: bool
) -> None:
    """The options of how the agent's runs are carried out (not of its requests)."""
    _check_concurrency_limit(where, concurrency_limit)
    _check_callable(where, on_text=on_text)
    _check_batch(where, batch, stream)


def _check_callable(where: str, **callbacks: Any) -> None:
    for label, value in callbacks.items():
        if value is not None and not callable(value):
            raise ImproperlyConfigured(f"{where}: {label} must be callable, got {value!r}")


def _check_thinking(where: str, thinking: Any, max_tokens: int) -> None:
    if thinking is None:
        return
    if not isinstance(thinking, dict):
        raise ImproperlyConfigured(f"{where}: thinking must be a dict, got {thinking!r}")
    budget = thinking.get("budget_tokens")
    # The API refuses this on every call; better to fail at import than on each run.
    if isinstance(budget, int) and budget >= max_tokens:
        raise ImproperlyConfigured(
            f"{where}: thinking budget_tokens ({budget}) must be less than "
            f"max_tokens ({max_tokens})"
        )


def _checked_params(where: str, params: Any, cache: Any) -> dict[str, Any]:
    """The other request parameters (``{}`` for None): a dict that sets none of the keys the
    agent sets itself, nor a cache_control of its own next to ``cache=True``."""
    params = {} if params is None else params
    if not isinstance(params, dict):
        raise ImproperlyConfigured(f"{where}: params must be a dict, got {params!r}")
    reserved = [key for key in params if key in RESERVED_PARAMS]
    if reserved:
        raise ImproperlyConfigured(
            f"{where}: params must not contain {', '.join(map(repr, reserved))}; "
            "pass model, system, tools, max_tokens, thinking and betas as Agent arguments "
            "(messages and stream are set by the runtime)"
        )
    if not isinstance(cache, bool):
        raise ImproperlyConfigured(f"{where}: cache must be True or False, got {cache!r}")
    if cache and "cache_control" in params:
        raise ImproperlyConfigured(
            f"{where}: cache=True sends a top-level cache_control of its own; leave "
            "cache_control out of params (or set it there and leave cache off)"
        )
    return params


def _checked_output(
    where: str, params: dict[str, Any], output_schema: dict[str, Any] | None
) -> OutputSchema | None:
    """The answer's schema (None: a text answer), checked against ``params``."""
    output = None if output_schema is None else OutputSchema(where, output_schema)
    _check_output_config(where, params, output)
    return output


def _check_output_config(where: str, params: dict[str, Any], output: OutputSchema | None) -> None:
    """With ``output_schema``, an ``output_config`` of ``params`` (its ``effort``) must be an
    object without a ``format`` of its own: one source of truth for what the answer must be."""
    config = params.get("output_config")
    if output is None or config is None:
        return
    if not isinstance(config, dict):
        raise ImproperlyConfigured(
            f"{where}: params['output_config'] must be a dict, got {config!r}"
        )
    if "format" in config:
        raise ImproperlyConfigured(
            f"{where}: give the final answer's JSON Schema once, as output_schema=...; "
            "leave format out of params['output_config']"
        )


def _tools_by_name(where: str, tools: Iterable[Any]) -> dict[str, Tool]:
    """The agent's tools by name: each one a ``Tool``, no two with the same name."""
    by_name: dict[str, Tool] = {}
    for item in tools:
        if not isinstance(item, Tool):
            shown = getattr(item, "__qualname__", None) or repr(item)
            raise ImproperlyConfigured(
                f"{where}: {shown} is not a tool; decorate it with @tool(effect=...)"
            )
        if item.name in by_name:
            raise ImproperlyConfigured(
                f"{where}: two tools are named {item.name!r} "
                f"({by_name[item.name]!r} and {item!r}); tool names must be unique"
            )
        by_name[item.name] = item
    return by_name


def _checked_betas(where: str, betas: Any) -> tuple[str, ...]:
    """The agent's anthropic-beta values: a list (or tuple) of non-empty strings without
    commas or whitespace (the header joins them with commas), duplicates dropped, order kept."""
    if isinstance(betas, str) or not isinstance(betas, list | tuple):
        raise ImproperlyConfigured(
            f"{where}: betas must be a list of anthropic-beta strings, got {betas!r}"
        )
    for beta in betas:
        if not isinstance(beta, str) or not beta or "," in beta or any(ch.isspace() for ch in beta):
            raise ImproperlyConfigured(
                f"{where}: each beta must be a non-empty string without commas or spaces "
                f"(an anthropic-beta value such as 'compact-2026-01-12'), got {beta!r}"
            )
    return tuple(dict.fromkeys(betas))


# Joins an agent's name, version and fingerprint into one text a claim compares (labels
# cannot contain control characters).
ROUTE_SEPARATOR = "\x1f"


def route_key(*parts: str) -> str:
    """``agent``, ``version`` (and a fingerprint) as claims compare them."""
    return ROUTE_SEPARATOR.join(parts)


@dataclasses.dataclass(frozen=True)
class Routing:
    """The runs a process's claims may take: ``serves``, route keys of (agent, version);
    ``refuses``, route keys of (agent, version, fingerprint) it cannot serve."""

    serves: tuple[str, ...]
    refuses: tuple[str, ...]

    def admits(self, agent: str, version: str, fingerprint: str) -> bool:
        return (
            route_key(agent, version) in self.serves
            and route_key(agent, version, fingerprint) not in self.refuses
        )


class AgentRegistry:
    """Agents by name and version, filled as apps' ``agents.py`` modules are imported."""

    def __init__(self) -> None:
        # name -> version -> agent; dicts keep registration order, which ``get`` relies on.
        self._agents: dict[str, dict[str, Agent]] = {}
        self._lock = threading.RLock()
        # (agent, version, fingerprint) of runs this process found it cannot serve: started
        # with another definition of a version it defines (``refuse``).
        self._refused: set[tuple[str, str, str]] = set()
        self._routing: Routing | None = None

    def register(self, agent: Agent) -> Agent:
        fingerprint = agent.fingerprint()
        with self._lock:
            versions = self._agents.setdefault(agent.name, {})
            existing = versions.get(agent.version)
            if (
                existing is not None
                and existing is not agent
                and existing.fingerprint() != fingerprint
            ):
                raise ImproperlyConfigured(
                    f"two agents are registered as {agent.label} with different "
                    f"definitions (fingerprints {existing.fingerprint()[:12]} and "
                    f"{fingerprint[:12]}); give the changed agent a new version, because "
                    "runs started on the old one must resume with exactly what they began with"
                )
            # Same fingerprint: the module was imported twice; replacing keeps the old position.
            versions[agent.version] = agent
            self._routing = None
        return agent

    def get(self, name: str, version: str | None = None) -> Agent:
        """The agent ``name`` at ``version``, or its most recently registered version."""
        with self._lock:
            versions = self._agents.get(name)
            if not versions:
                known = ", ".join(sorted(self._agents)) or "none"
                asked = f" (version {version!r})" if version is not None else ""
                raise AgentNotFound(
                    f"no agent named {name!r}{asked} is registered; registered agents: {known}. "
                    "Is it defined in the agents.py of an app in INSTALLED_APPS?"
                )
            if version is None:
                return next(reversed(versions.values()))
            agent = versions.get(version)
            if agent is None:
                raise AgentNotFound(
                    f"agent {name!r} has no version {version!r}; registered versions: "
                    f"{', '.join(versions)}. Keep an old version registered until its runs end."
                )
            return agent

    def versions(self, name: str) -> list[str]:
        """The registered versions of ``name`` in registration order ([] if none)."""
        with self._lock:
            return list(self._agents.get(name, {}))

    def all(self) -> list[Agent]:
        with self._lock:
            return [agent for versions in self._agents.values() for agent in versions.values()]

    def unregister(self, name: str, version: str) -> None:
        """Forget one agent version; a no-op when it is not registered (handy in cleanups)."""
        with self._lock:
            versions = self._agents.get(name)
            if versions is not None:
                versions.pop(version, None)
                if not versions:
                    del self._agents[name]
            self._refused = {r for r in self._refused if r[:2] != (name, version)}
            self._routing = None

    def clear(self) -> None:
        with self._lock:
            self._agents.clear()
            self._refused.clear()
            self._routing = None

    def routing(self) -> Routing:
        """What a claim of this process may take: the agent versions it defines, less the
        definitions of them it found it cannot serve. Built once per change of the registry."""
        with self._lock:
            if self._routing is None:
                self._routing = Routing(
                    serves=tuple(
                        route_key(name, version)
                        for name, versions in self._agents.items()
                        for version in versions
                    ),
                    refuses=tuple(sorted(route_key(*refused) for refused in self._refused)),
                )
            return self._routing

    def forget_refusals(self) -> None:
        """Serve every definition of the registered versions again (tests)."""
        with self._lock:
            self._refused.clear()
            self._routing = None

    def refuse(self, name: str, version: str, fingerprint: str) -> None:
        """Runs of ``name``@``version`` started with ``fingerprint`` are not this process's:
        its definition of that version differs (drift). Its claims skip them from now on."""
        with self._lock:
            if (name, version, fingerprint) not in self._refused:
                self._refused.add((name, version, fingerprint))
                self._routing = None

    def __contains__(self, key: object) -> bool:
        if isinstance(key, tuple) and len(key) == 2:
            with self._lock:
                return key[1] in self._agents.get(key[0], {})
        return False

    def __len__(self) -> int:
        with self._lock:
            return sum(len(v) for v in self._agents.values())


registry = AgentRegistry()


def get_agent(name: str, version: str | None = None) -> Agent:
    return registry.get(name, version)
