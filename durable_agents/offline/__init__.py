r"""A deterministic, offline, scripted stand-in for the Anthropic Messages API.

``POST /v1/messages``, as JSON or, with ``"stream": true``, as server-sent events. Used behind
the real SDK through ``httpx2.MockTransport`` when no API key is configured
(``offline_client()``), and by tests behind a real local HTTP server (``OfflineServer``).

The script lives in the task (the text of the first user message): lines starting with ``@``
are the model's turns, ``@@`` lines are directives (latency, hostile turns, the final text,
repeats); see ``durable_agents.offline.script``.

Thinking signatures are the point of this module: like the real API, a thinking block is only
accepted back if everything it was produced from (model, system, tools, earlier messages, its
text) is sent back byte-identical in value and key order. This is what lets tests prove that a
durable store replays history verbatim. It deliberately imports neither Django nor the database.

Given ``RateLimits`` (``offline_client(rate_limits=...)``, ``ScriptedModel(rate_limits=...)``),
it limits requests per minute and input and output tokens per minute as the API does: token
buckets, 429 ``rate_limit_error`` answers with ``retry-after``, ``anthropic-ratelimit-*``
headers on every answer; see ``durable_agents.offline.limits``.

The Message Batches API (``/v1/messages/batches``: create, list, retrieve, results, cancel,
delete) is answered by a ``BatchDesk`` (``ScriptedModel(batches=...)``; by default one
process-wide desk shared by every model): each request of a batch is answered by the model as
a direct request would be, when the batch ends, and its result line holds the answer's exact
bytes. Its knobs (processing time on a clock, expired and errored shares, a queue limit), its
faults for tests of bad input and its statistics are in ``durable_agents.offline.batches``.

Long transcripts (server-side compaction, context editing, automatic prompt caching) are
modelled as the real API documents them; see ``durable_agents.offline.compaction``.

One module per job:

- ``script``: the script language (plan lines and directives) and its parser;
- ``signatures``: the canonical bytes of a value and the thinking signatures over them;
- ``requests``: a request checked as the API checks it (fields, roles, signatures, caching);
- ``compaction``: the compaction edit, the block it writes and the view of a request after it;
- ``model``: ``ScriptedModel``, the answer to one request;
- ``batches``: ``BatchDesk``, the Message Batches endpoints (batches, results, faults, stats);
- ``limits``: ``RateLimits``, the API's rate limits (token buckets, 429s, their headers);
- ``sse``: the answer as server-sent events;
- ``transport``: ``offline_client`` (in-process) and ``OfflineServer`` (a real HTTP server);
- ``wire``: what the model shares with the real API (constants, error answers, ids, JSON bytes).
"""

from durable_agents._internal.deepjson import dumps_deep, loads_deep
from durable_agents.offline.batches import BatchDesk, BatchStats, shared_batch_desk
from durable_agents.offline.compaction import (
    COMPACT_BETA,
    CONTEXT_EDITING_BETA,
    OFFLINE_MIN_COMPACTION_TRIGGER,
)
from durable_agents.offline.limits import Admission, RateLimits, Rejection, billed_input_tokens
from durable_agents.offline.model import ScriptedModel
from durable_agents.offline.script import (
    PlanCall,
    Script,
    answer_directive,
    final_directive,
    parse_script,
    turn_directive,
)
from durable_agents.offline.signatures import canonical_bytes, sign
from durable_agents.offline.transport import OfflineServer, offline_client
from durable_agents.offline.wire import DEFAULT_SECRET, RETIRED_MODELS

__all__ = [
    "COMPACT_BETA",
    "CONTEXT_EDITING_BETA",
    "DEFAULT_SECRET",
    "OFFLINE_MIN_COMPACTION_TRIGGER",
    "RETIRED_MODELS",
    "Admission",
    "BatchDesk",
    "BatchStats",
    "OfflineServer",
    "PlanCall",
    "RateLimits",
    "Rejection",
    "Script",
    "ScriptedModel",
    "answer_directive",
    "billed_input_tokens",
    "canonical_bytes",
    "dumps_deep",
    "final_directive",
    "loads_deep",
    "offline_client",
    "parse_script",
    "shared_batch_desk",
    "sign",
    "turn_directive",
]
