"""``RunContext``: what a tool may know of the run that calls it.

A tool declares a parameter annotated ``RunContext`` (any name: the annotation is what counts)
and the runtime passes it one, as it passes ``idempotency_key``; the parameter is never part
of the schema the model sees. The object is frozen and holds a copy of the run's metadata, so a
tool cannot change the run through it.

This module never imports Django models: ``agents.py`` modules import it at app loading.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import types
from collections.abc import Mapping, MutableMapping
from typing import Any

from durable_agents.logging import bind_run

__all__ = ["RunContext", "RunLogger"]

# The logger a RunContext's ``logger`` writes to, below the app's loggers: its records have
# their control characters escaped like the app's own (logging.py).
TOOLS_LOGGER = "durable_agents.tools"


class RunLogger(logging.LoggerAdapter[logging.Logger]):
    """A logger bound to one run: every record it makes carries the run's id as ``run_id``,
    on whichever thread or task the tool runs."""

    def __init__(self, logger: logging.Logger, run_id: str) -> None:
        super().__init__(logger, {})
        self.run_id = run_id

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, Any]:
        return msg, kwargs

    def log(self, level: int, msg: Any, *args: Any, **kwargs: Any) -> None:
        # The record factory reads the run id from the context when the record is made.
        with bind_run(self.run_id):
            super().log(level, msg, *args, **kwargs)


def _frozen(metadata: Mapping[str, Any]) -> Mapping[str, Any]:
    return types.MappingProxyType(copy.deepcopy(dict(metadata)))


@dataclasses.dataclass(frozen=True)
class RunContext:
    """The run a tool call belongs to: its id, agent and version, the metadata it was started
    with, its start key and concurrency key, the claim (``attempt``) that makes the call, and a
    ``logger`` bound to it. Built by the runtime for each call; a test may build one itself
    (``RunContext(id=..., agent="support")``)."""

    id: Any
    agent: str
    version: str = ""
    metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    key: str | None = None
    concurrency_key: str | None = None
    attempt: int = 0
    # The logger's name: ``durable_agents.tools.<tool>`` when the runtime builds it.
    logger_name: dataclasses.InitVar[str | None] = None
    logger: logging.LoggerAdapter[logging.Logger] = dataclasses.field(
        init=False, repr=False, compare=False
    )

    def __post_init__(self, logger_name: str | None) -> None:
        object.__setattr__(self, "metadata", _frozen(self.metadata))
        logger = logging.getLogger(logger_name or TOOLS_LOGGER)
        object.__setattr__(self, "logger", RunLogger(logger, str(self.id)))
