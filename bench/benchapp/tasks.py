"""The django-q2 task of the peer benchmark: one model call against the fake API."""

from __future__ import annotations

import os
import threading

import anthropic

_local = threading.local()


def _client() -> anthropic.Anthropic:
    client = getattr(_local, "client", None)
    if client is None:
        client = anthropic.Anthropic(
            api_key=os.environ.get("ANTHROPIC_API_KEY", "bench"),
            base_url=os.environ["ANTHROPIC_BASE_URL"],
            max_retries=0,
        )
        _local.client = client
    return client


def one_step(task: str) -> str:
    """What a one-step run does: one model call, its text as the result."""
    from bench.benchapp.agents import bench

    params = bench.request_params(bench.model)
    resp = _client().messages.create(messages=[{"role": "user", "content": task}], **params)
    return resp.content[0].text if resp.content else ""
