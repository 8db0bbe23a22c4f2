"""The Message Batches API of the offline model: ``BatchDesk`` keeps the batches and answers
``/v1/messages/batches`` (create, list, retrieve, results, cancel, delete) as the API does.

A batch's requests are answered by the model that created it, as the pure function it is
(``POST /v1/messages`` with the params of the request and the ``anthropic-beta`` header of the
create), lazily, when the batch ends; the answers are kept. A succeeded result's ``message`` is
the exact bytes of the model's answer, spliced into the result line as text, so a client that
reads the results body itself can keep a turn's raw text.

Knobs (plain attributes, read at each create): ``processing_seconds`` (how long after its
create a batch ends; its requests are done one after the other in that time), ``expire_ratio``
and ``error_ratio`` (the share of requests that come back ``expired`` or ``errored`` with an
``overloaded_error``, drawn from a hash of the batch id and the ``custom_id``) and
``max_queued_requests`` (a create that would put more requests in the processing queue gets a
429 ``rate_limit_error`` with ``retry-after``). Faults for tests of bad input (``fail_results``,
``add_unknown_result``, ``duplicate_result``, ``break_result_line``, ``put_nul_in_result``,
``put_lone_surrogate_in_result``, ``stick_next``) and statistics (``stats()``) complete it."""

from __future__ import annotations

import dataclasses
import json
import json.scanner
import math
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any, Literal
from urllib.parse import parse_qs

from durable_agents._internal.deepjson import loads_deep
from durable_agents.offline.wire import (
    MESSAGES_PATH,
    RequestError,
    Response,
    header,
    hex24,
    invalid,
    json_bytes,
)

BATCHES_PATH = MESSAGES_PATH + "/batches"
# A batch expires (ends, its unanswered requests ``expired``) this long after its create.
EXPIRY_SECONDS = 24 * 3600.0
MAX_BATCH_REQUESTS = 100_000
CUSTOM_ID = re.compile(r"[a-zA-Z0-9_-]{1,64}")
# The retry-after of a queue-limit 429 when no batch in the queue will end by itself.
QUEUE_RETRY_AFTER = 60

# Answers one Messages request: (headers, body) -> (status, headers, body).
Answerer = Callable[[Mapping[str, str], bytes], Response]

LineFault = Literal["unknown", "duplicate", "not_json", "nul", "lone_surrogate"]
LINE_FAULTS: tuple[LineFault, ...] = ("unknown", "duplicate", "not_json", "nul", "lone_surrogate")


def is_batch_path(path: str) -> bool:
    """Whether ``path`` (query string allowed) is one of the Message Batches endpoints."""
    path = path.split("?", 1)[0].rstrip("/")
    return path == BATCHES_PATH or path.startswith(BATCHES_PATH + "/")


@dataclasses.dataclass(frozen=True)
class BatchStats:
    """What a ``BatchDesk`` saw, as of ``BatchDesk.stats()``.

    ``retrieves`` and ``results_downloads`` count requests per batch id; ``batch_sizes`` is the
    size of every batch created, in order; ``succeeded`` how many times each ``custom_id`` came
    back succeeded (over every batch: more than once is a turn paid twice); ``usage`` the total
    usage of the succeeded answers (``input_tokens``, ``output_tokens``,
    ``cache_creation_input_tokens``, ``cache_read_input_tokens``)."""

    creates: int
    rejected_creates: int  # 429s of the queue limit
    retrieves: dict[str, int]
    results_downloads: dict[str, int]
    cancels: int
    batch_sizes: list[int]
    succeeded: dict[str, int]
    usage: dict[str, int]

    @property
    def paid_twice(self) -> dict[str, int]:
        """The ``custom_id``s answered succeeded more than once, and how many times."""
        return {cid: n for cid, n in self.succeeded.items() if n > 1}

    @property
    def downloads(self) -> int:
        """Results downloads, over every batch."""
        return sum(self.results_downloads.values())


@dataclasses.dataclass
class _Batch:
    id: str
    created_at: float
    ends_at: float  # when processing ends by itself (created_at + processing_seconds)
    # (custom_id, params): each request's params as the create's body held them (the bytes
    # a direct call would have sent), in the order sent.
    requests: list[tuple[str, bytes]]
    betas: str  # the create's anthropic-beta header: it applies to every request
    answer: Answerer
    expire_ratio: float
    error_ratio: float
    stuck: bool
    order: list[int]  # indexes into requests: the order they are done and their results given
    status: str = "in_progress"
    cancel_initiated_at: float | None = None
    ended_at: float | None = None
    counts: dict[str, int] = dataclasses.field(default_factory=dict)
    lines: list[bytes] = dataclasses.field(default_factory=list)

    @property
    def expires_at(self) -> float:
        return self.created_at + EXPIRY_SECONDS

    def done_at(self, position: int) -> float:
        """When the request at ``position`` in the processing order is done."""
        if self.stuck:
            return math.inf
        n = len(self.requests)
        return self.created_at + (self.ends_at - self.created_at) * (position + 1) / n


def _timestamp(t: float | None) -> str | None:
    if t is None:
        return None
    return datetime.fromtimestamp(t, UTC).isoformat().replace("+00:00", "Z")


def _draw(salt: str, batch_id: str, custom_id: str) -> float:
    """A number in [0, 1) that is a function of the batch and the request: a request sent again
    in a new batch gets a fresh draw."""
    return int(hex24(salt, batch_id, custom_id), 16) / 16**24


def _error_body(error_type: str, message: str, request_id: str) -> bytes:
    return json_bytes(
        {
            "type": "error",
            "error": {"type": error_type, "message": message},
            "request_id": request_id,
        }
    )


def _line(custom_id: str, result: bytes) -> bytes:
    return b'{"custom_id":"' + custom_id.encode("ascii") + b'","result":' + result + b"}\n"


def _succeeded(message: bytes) -> bytes:
    return b'{"type":"succeeded","message":' + message + b"}"


class BatchDesk:
    """The batches of one or more offline models, thread-safe.

    ``processing_seconds``: how long after its create a batch ends (0: at the first look after
    the create); its requests are done one after the other in that time, so a cancel leaves
    those already done answered and the rest ``canceled``. ``clock``: the time (seconds since
    the epoch; a fake clock drives a test). ``expire_ratio``, ``error_ratio``: the share of
    requests that come back ``expired``, or ``errored`` with an ``overloaded_error``.
    ``max_queued_requests``: the most requests waiting in the processing queue (batches not
    ended) a create may leave; past it, a 429 ``rate_limit_error`` with ``retry-after``.

    ``respond(method, path, headers, body, answer)`` answers an endpoint; ``answer`` answers
    one Messages request for a batch created by that call. ``reset()`` forgets everything and
    restores the constructor's knobs."""

    def __init__(
        self,
        *,
        processing_seconds: float = 0.0,
        clock: Callable[[], float] = time.time,
        expire_ratio: float = 0.0,
        error_ratio: float = 0.0,
        max_queued_requests: int | None = None,
    ) -> None:
        self._knobs = (processing_seconds, clock, expire_ratio, error_ratio, max_queued_requests)
        self._lock = threading.RLock()
        self.reset()

    def reset(self) -> None:
        """Forget every batch, fault and statistic; the knobs go back to the constructor's."""
        with self._lock:
            (
                self.processing_seconds,
                self.clock,
                self.expire_ratio,
                self.error_ratio,
                self.max_queued_requests,
            ) = self._knobs
            self._batches: dict[str, _Batch] = {}
            self._serial = 0
            self._results_failures: list[int] = []
            self._line_faults: Counter[str] = Counter()
            self._stuck = 0
            self._creates = 0
            self._rejected = 0
            self._retrieves: Counter[str] = Counter()
            self._downloads: Counter[str] = Counter()
            self._cancels = 0
            self._sizes: list[int] = []
            self._succeeded: Counter[str] = Counter()
            self._usage: Counter[str] = Counter()

    # -- faults ---------------------------------------------------------------------------

    def fail_results(self, status: int = 500, times: int = 1) -> None:
        """The next ``times`` results downloads (of any batch that has ended) answer ``status``
        (404 ``not_found_error``, 500 ``api_error``, or any error status) instead."""
        with self._lock:
            self._results_failures.extend([status] * times)

    def add_unknown_result(self, times: int = 1) -> None:
        """The next ``times`` batches that end have one more result line, for a ``custom_id``
        never sent (a copy of a succeeded result when there is one)."""
        self._add_line_fault("unknown", times)

    def duplicate_result(self, times: int = 1) -> None:
        """The next ``times`` batches that end give the result of one request twice (the first
        line again, at the end)."""
        self._add_line_fault("duplicate", times)

    def break_result_line(self, times: int = 1) -> None:
        """The next ``times`` batches that end have a result line that is not JSON (the first
        line cut in half)."""
        self._add_line_fault("not_json", times)

    def put_nul_in_result(self, times: int = 1) -> None:
        """The next ``times`` batches that end with a succeeded result have a raw NUL byte in
        the text of the first succeeded message (invalid JSON: a raw control character)."""
        self._add_line_fault("nul", times)

    def put_lone_surrogate_in_result(self, times: int = 1) -> None:
        """The next ``times`` batches that end with a succeeded result have an escaped lone
        surrogate (``\\ud800``, valid JSON text) in the text of the first succeeded message."""
        self._add_line_fault("lone_surrogate", times)

    def stick_next(self, times: int = 1) -> None:
        """The next ``times`` batches created stay ``in_progress`` forever, past their
        ``expires_at``; a cancel still ends them (every request ``canceled``)."""
        with self._lock:
            self._stuck += times

    def _add_line_fault(self, kind: LineFault, times: int) -> None:
        with self._lock:
            self._line_faults[kind] += times

    # -- statistics -----------------------------------------------------------------------

    def stats(self) -> BatchStats:
        """A snapshot of the statistics."""
        with self._lock:
            return BatchStats(
                creates=self._creates,
                rejected_creates=self._rejected,
                retrieves=dict(self._retrieves),
                results_downloads=dict(self._downloads),
                cancels=self._cancels,
                batch_sizes=list(self._sizes),
                succeeded=dict(self._succeeded),
                usage={
                    key: self._usage[key]
                    for key in (
                        "input_tokens",
                        "output_tokens",
                        "cache_creation_input_tokens",
                        "cache_read_input_tokens",
                    )
                },
            )

    def batch_ids(self) -> list[str]:
        """Every batch's id, in the order created."""
        with self._lock:
            return list(self._batches)

    def queued_requests(self) -> int:
        """Requests in batches that have not ended, as of now."""
        with self._lock:
            now = self.clock()
            for batch in self._batches.values():
                self._advance(batch, now)
            return sum(len(b.requests) for b in self._batches.values() if b.status != "ended")

    # -- the endpoints --------------------------------------------------------------------

    def respond(
        self,
        method: str,
        path: str,
        headers: Mapping[str, str],
        body: bytes,
        answer: Answerer,
    ) -> Response:
        """The answer of a Message Batches endpoint; ``answer`` answers the requests of a batch
        this call creates."""
        path, _, query = path.partition("?")
        parts = path.rstrip("/")[len(BATCHES_PATH) :].strip("/").split("/")
        method = method.upper()
        with self._lock:
            request_id = "req_offline_" + hex24("batches", method, path, body, self._serial)
        try:
            with self._lock:
                if parts == [""]:
                    if method == "POST":
                        return self._create(headers, body, answer, request_id)
                    if method == "GET":
                        return self._ok(self._list(headers, parse_qs(query)), request_id)
                elif len(parts) == 1 and method == "GET":
                    self._retrieves[parts[0]] += 1
                    return self._ok(self._render(self._look(parts[0]), headers), request_id)
                elif len(parts) == 1 and method == "DELETE":
                    return self._ok(self._delete(parts[0]), request_id)
                elif len(parts) == 2 and parts[1] == "results" and method == "GET":
                    return self._results(parts[0], request_id)
                elif len(parts) == 2 and parts[1] == "cancel" and method == "POST":
                    return self._ok(self._render(self._cancel(parts[0]), headers), request_id)
                raise RequestError(404, "not_found_error", f"{method} {path}: not found")
        except RequestError as e:
            extra = {"retry-after": str(e.retry_after)} if isinstance(e, _QueueFull) else {}
            return (
                e.status,
                {"content-type": "application/json", "request-id": request_id, **extra},
                _error_body(e.error_type, e.message, request_id),
            )

    @staticmethod
    def _ok(payload: dict[str, Any], request_id: str) -> Response:
        headers = {"content-type": "application/json", "request-id": request_id}
        return 200, headers, json_bytes(payload)

    def _create(
        self, headers: Mapping[str, str], body: bytes, answer: Answerer, request_id: str
    ) -> Response:
        requests = _checked_requests(body)
        now = self.clock()
        if self.max_queued_requests is not None:
            queued = self.queued_requests()
            if queued + len(requests) > self.max_queued_requests:
                self._rejected += 1
                raise _QueueFull(
                    f"Number of requests in the processing queue would pass the limit of "
                    f"{self.max_queued_requests} ({queued} waiting, {len(requests)} sent).",
                    self._queue_retry_after(now),
                )
        self._serial += 1
        batch_id = "msgbatch_" + hex24("batch", self._serial, now, body, id(self))
        stuck = self._stuck > 0
        if stuck:
            self._stuck -= 1
        order = sorted(range(len(requests)), key=lambda i: hex24("order", batch_id, requests[i][0]))
        batch = _Batch(
            id=batch_id,
            created_at=now,
            ends_at=now + max(0.0, self.processing_seconds),
            requests=requests,
            betas=header(headers, "anthropic-beta"),
            answer=answer,
            expire_ratio=self.expire_ratio,
            error_ratio=self.error_ratio,
            stuck=stuck,
            order=order,
        )
        self._batches[batch_id] = batch
        self._creates += 1
        self._sizes.append(len(requests))
        return self._ok(self._render(batch, headers), request_id)

    def _queue_retry_after(self, now: float) -> int:
        ends = [
            b.ends_at
            for b in self._batches.values()
            if b.status == "in_progress" and not b.stuck and b.ends_at > now
        ]
        if not ends:
            return QUEUE_RETRY_AFTER
        return max(1, math.ceil(min(ends) - now))

    def _look(self, batch_id: str) -> _Batch:
        """The batch as of now (ended if its time came); 404 for an unknown id."""
        batch = self._batches.get(batch_id)
        if batch is None:
            raise RequestError(404, "not_found_error", f"message batch {batch_id} not found")
        self._advance(batch, self.clock())
        return batch

    def _list(self, headers: Mapping[str, str], query: dict[str, list[str]]) -> dict[str, Any]:
        """Newest first, ``limit`` (1 to 1000, default 20) at a time, after ``after_id`` or
        before ``before_id``."""
        try:
            limit = int(query.get("limit", ["20"])[0])
        except ValueError:
            raise invalid("limit: must be an integer") from None
        if not 1 <= limit <= 1000:
            raise invalid("limit: must be between 1 and 1000")
        ids = list(reversed(self._batches))
        if "after_id" in query and query["after_id"][0] in ids:
            ids = ids[ids.index(query["after_id"][0]) + 1 :]
        elif "before_id" in query and query["before_id"][0] in ids:
            ids = ids[: ids.index(query["before_id"][0])][-limit:]
        page = ids[:limit]
        return {
            "data": [self._render(self._look(i), headers) for i in page],
            "has_more": len(ids) > limit,
            "first_id": page[0] if page else None,
            "last_id": page[-1] if page else None,
        }

    def _delete(self, batch_id: str) -> dict[str, Any]:
        batch = self._look(batch_id)
        if batch.status != "ended":
            raise invalid(f"message batch {batch_id} cannot be deleted while it is processing")
        del self._batches[batch_id]
        return {"id": batch_id, "type": "message_batch_deleted"}

    def _cancel(self, batch_id: str) -> _Batch:
        batch = self._look(batch_id)
        self._cancels += 1
        if batch.status == "in_progress":
            batch.status = "canceling"
            batch.cancel_initiated_at = self.clock()
        return batch

    def _results(self, batch_id: str, request_id: str) -> Response:
        self._downloads[batch_id] += 1
        batch = self._look(batch_id)
        if batch.status != "ended":
            raise invalid(f"message batch {batch_id} has not finished processing")
        if self._results_failures:
            status = self._results_failures.pop(0)
            kind = {404: "not_found_error", 429: "rate_limit_error", 529: "overloaded_error"}
            error_type = kind.get(status, "api_error" if status >= 500 else "invalid_request_error")
            raise RequestError(status, error_type, f"results of {batch_id}: injected failure")
        headers = {"content-type": "application/binary", "request-id": request_id}
        return 200, headers, b"".join(batch.lines)

    def _render(self, batch: _Batch, headers: Mapping[str, str]) -> dict[str, Any]:
        """The ``MessageBatch`` object; its ``results_url`` is on the host the client asked."""
        if batch.status == "ended":
            counts = batch.counts
            host = header(headers, "host") or "offline.invalid"
            results_url: str | None = f"http://{host}{BATCHES_PATH}/{batch.id}/results"
        else:
            counts = {"processing": len(batch.requests)}
            results_url = None
        return {
            "id": batch.id,
            "type": "message_batch",
            "processing_status": batch.status,
            "request_counts": {
                key: counts.get(key, 0)
                for key in ("processing", "succeeded", "errored", "canceled", "expired")
            },
            "created_at": _timestamp(batch.created_at),
            "expires_at": _timestamp(batch.expires_at),
            "ended_at": _timestamp(batch.ended_at),
            "cancel_initiated_at": _timestamp(batch.cancel_initiated_at),
            "archived_at": None,
            "results_url": results_url,
        }

    # -- processing -----------------------------------------------------------------------

    def _advance(self, batch: _Batch, now: float) -> None:
        """End the batch if its time came by ``now``: cancelled (at the first look after the
        cancel), done, or expired."""
        if batch.status == "ended":
            return
        if batch.status == "canceling":
            assert batch.cancel_initiated_at is not None
            self._end(batch, now, batch.cancel_initiated_at, "canceled")
        elif batch.stuck:
            return
        elif batch.ends_at <= batch.expires_at and now >= batch.ends_at:
            self._end(batch, batch.ends_at, math.inf, "canceled")
        elif now >= batch.expires_at:
            self._end(batch, batch.expires_at, batch.expires_at, "expired")

    def _end(self, batch: _Batch, ended_at: float, cutoff: float, undone: str) -> None:
        """Answer every request done by ``cutoff``; the others are ``undone``."""
        counts: Counter[str] = Counter()
        lines: list[bytes] = []
        succeeded: list[int] = []  # indexes in lines
        answer_headers = {"anthropic-beta": batch.betas} if batch.betas else {}
        for position, index in enumerate(batch.order):
            custom_id, params = batch.requests[index]
            if batch.done_at(position) > cutoff:
                kind, result = undone, b'{"type":"' + undone.encode() + b'"}'
            elif _draw("expire", batch.id, custom_id) < batch.expire_ratio:
                kind, result = "expired", b'{"type":"expired"}'
            elif _draw("error", batch.id, custom_id) < batch.error_ratio:
                request_id = "req_offline_" + hex24("overloaded", batch.id, custom_id)
                error = _error_body("overloaded_error", "Overloaded", request_id)
                kind, result = "errored", b'{"type":"errored","error":' + error + b"}"
            else:
                status, _, out = batch.answer(answer_headers, params)
                if status == 200:
                    kind, result = "succeeded", _succeeded(out)
                    succeeded.append(len(lines))
                    self._succeeded[custom_id] += 1
                    usage = loads_deep(out).get("usage") or {}
                    for key, value in usage.items():
                        if isinstance(value, int) and key.endswith("tokens"):
                            self._usage[key] += value
                else:
                    kind, result = "errored", b'{"type":"errored","error":' + out + b"}"
            counts[kind] += 1
            lines.append(_line(custom_id, result))
        batch.status = "ended"
        batch.ended_at = ended_at
        batch.counts = dict(counts)
        batch.lines = self._faulty(batch, lines, succeeded)

    def _faulty(self, batch: _Batch, lines: list[bytes], succeeded: list[int]) -> list[bytes]:
        """``lines`` with the pending line faults applied (each fault taken once)."""
        for kind in LINE_FAULTS:
            if self._line_faults[kind] <= 0:
                continue
            if kind in ("nul", "lone_surrogate"):
                if not succeeded:
                    continue  # stays pending: no message to put it in
                at = succeeded[0]
                marker = b'"text": "'
                cut = lines[at].find(marker)
                if cut < 0:
                    continue
                cut += len(marker)
                bad = b"\x00" if kind == "nul" else b"\\ud800"
                lines[at] = lines[at][:cut] + bad + lines[at][cut:]
            elif kind == "unknown":
                result = (
                    lines[succeeded[0]].split(b',"result":', 1)[1][:-2]
                    if succeeded
                    else b'{"type":"canceled"}'
                )
                lines.append(_line("never_sent_" + hex24("unknown", batch.id), result))
            elif kind == "duplicate":
                lines.append(lines[0])
            else:  # not_json
                lines[0] = lines[0][: len(lines[0]) // 2] + b"\n"
            self._line_faults[kind] -= 1
        return lines


class _QueueFull(RequestError):
    """The queue limit's 429, with its retry-after."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(429, "rate_limit_error", message)
        self.retry_after = retry_after


def _checked_requests(body: bytes) -> list[tuple[str, bytes]]:
    """The requests of a create, checked as the API checks them: (custom_id, params)."""
    try:
        payload = loads_deep(body)
    except (ValueError, UnicodeDecodeError):
        raise invalid("the request body is not valid JSON") from None
    if not isinstance(payload, dict):
        raise invalid("the request body must be an object")
    requests = payload.get("requests")
    if not isinstance(requests, list) or not requests:
        raise invalid("requests: must be a non-empty list")
    if len(requests) > MAX_BATCH_REQUESTS:
        raise invalid(f"requests: a batch holds at most {MAX_BATCH_REQUESTS} requests")
    seen: set[str] = set()
    checked: list[tuple[str, Any]] = []
    for n, item in enumerate(requests):
        if not isinstance(item, dict):
            raise invalid(f"requests.{n}: must be an object")
        custom_id = item.get("custom_id")
        if not isinstance(custom_id, str) or not CUSTOM_ID.fullmatch(custom_id):
            raise invalid(f"requests.{n}.custom_id: must match ^[a-zA-Z0-9_-]{{1,64}}$")
        if custom_id in seen:
            raise invalid(f"requests.{n}.custom_id: {custom_id} is not unique in the batch")
        seen.add(custom_id)
        params = item.get("params")
        if not isinstance(params, dict):
            raise invalid(f"requests.{n}.params: must be an object")
        if params.get("stream") is True:
            raise invalid(f"requests.{n}.params.stream: streaming is not supported in batches")
        checked.append((custom_id, params))
    raw = _raw_params(body, len(checked))
    return [
        (custom_id, raw[n] if raw is not None else json_bytes(params))
        for n, (custom_id, params) in enumerate(checked)
    ]


def _raw_params(body: bytes, count: int) -> list[bytes] | None:
    """Each request's ``params`` as the create's body wrote them, so that a request answers
    (and bills) exactly as the same body sent directly would; None if the body cannot be cut
    so (its values then go re-encoded)."""
    text = body.decode("utf-8", "surrogatepass")
    scan = json.scanner.make_scanner(json.JSONDecoder())  # type: ignore[arg-type]

    def members(i: int) -> dict[str, tuple[int, int]]:
        found: dict[str, tuple[int, int]] = {}
        i = _skip(text, i)
        assert text[i] == "{"
        i = _skip(text, i + 1)
        while text[i] == '"':
            key, i = json.decoder.scanstring(text, i + 1)  # type: ignore[attr-defined]
            i = _skip(text, i)
            i = _skip(text, i + 1)  # the colon
            end = scan(text, i)[1]
            found[key] = (i, end)
            i = _skip(text, end)
            if text[i] != ",":
                break
            i = _skip(text, i + 1)
        return found

    try:
        start, _ = members(0)["requests"]
        i = _skip(text, start + 1)
        out: list[bytes] = []
        while len(out) < count:
            end = scan(text, i)[1]
            params = members(i)["params"]
            out.append(text[params[0] : params[1]].encode("utf-8", "surrogatepass"))
            i = _skip(text, _skip(text, end) + 1)
        return out
    except (AssertionError, IndexError, KeyError, ValueError, StopIteration, RecursionError):
        return None


def _skip(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\n\r":
        i += 1
    return i


_shared: BatchDesk | None = None
_shared_lock = threading.Lock()


def shared_batch_desk() -> BatchDesk:
    """The process-wide ``BatchDesk``: every ``ScriptedModel`` not given one shares it, so the
    in-process clients of one process share their batches."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = BatchDesk()
        return _shared
