"""How the admin lists, counts and searches runs when the table holds millions of them.

A page of the admin must cost what it shows, not what the table holds
(docs/howto/admin-at-scale.md, "The admin at ten million runs"). The flow of a runs-list
request, and where each step lives:

1. **Filters** become index conditions: status, agent and model through the indexes led by
   them, "created" through ``agent_run_created``. The agent and model filters list their
   values with a skip scan (``distinct_values``): one index probe per value, not a scan.
2. **Search** (``search_runs``) reads what the operator typed and asks the one index that
   can answer it: a whole run id (the primary key), the first characters of one (a range of
   the primary key), the short id of a time-ordered one (its last 8 hex digits,
   ``agent_run_id_tail``), a request id or its prefix (``agent_step_request_id_prefix``),
   words of a task (``agent_step_task_trgm``, a trigram index on the task step, which is
   written once and never updated) or of a dead or failed run's reason
   (``agent_run_error_trgm``). Whatever the term looks like, a run started with exactly that
   key (``start_run(..., key=...)``) is found too, through ``agent_run_start_key``, in the
   same query.
3. **Counting** (``EstimatingPaginator``) is exact up to ``EXACT_COUNT_LIMIT`` rows, which it
   reads at most; past that the count is the planner's estimate and says so ("about 1.2
   million").
4. **Paging** reaches back ``EXACT_COUNT_LIMIT`` rows (``EstimatingPaginator.max_pages``
   pages), so that no page asks for a deep OFFSET; a filter or a search goes further.

Counting itself is ``durable_agents._internal.counting`` (the figures and the Prometheus
gauges count the same way). What differs between databases in search is behind ``Dialect``:
PostgreSQL looks words up in its trigram indexes; the portable dialect (SQLite) scans for words,
which is fine at its sizes. Both match words the same way (``Dialect.contains_words``).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from django.contrib.humanize.templatetags.humanize import intcomma
from django.core.paginator import Paginator
from django.db import connections
from django.db.models import BooleanField, Exists, F, Func, OuterRef, Q, QuerySet, Value
from django.utils.functional import cached_property
from django.utils.translation import gettext, ngettext

from durable_agents._internal import counting, encryption
from durable_agents._internal.counting import Count, bounded_count
from durable_agents.models import AgentRun, AgentStep, RunStatus, StepKind
from durable_agents.models.runs import metadata_match, short_id_match

# Distinct values a filter lists (agents, models); more than that is not a filter any more.
MAX_FILTER_VALUES = 100
# Search by words or request id: the newest matches found through the index, at most this
# many, are what the list then filters, counts and pages.
MAX_SEARCH_MATCHES = 1_000
# Dead and failed runs keep a reason worth searching (agent_run_error_trgm covers them only).
REASON_STATUSES = (RunStatus.DEAD, RunStatus.FAILED)
# Search by words reads the tasks of this many newest runs directly before asking the index.
RECENT_WINDOW = 10_000
# Shortest word a trigram index can look up (shorter words would scan).
MIN_WORD_CHARS = 3

_REQUEST_ID = re.compile(r"^(req|msg)_[A-Za-z0-9_-]+$")


class ILike(Func):
    """``text ILIKE pattern``, the form PostgreSQL's trigram indexes answer (Django's
    ``icontains`` compares UPPER() of both sides, which no trigram index serves)."""

    arg_joiner = " ILIKE "
    template = "%(expressions)s"
    output_field = BooleanField()


_WORD_CHAR = re.compile(r"\w")
_PUNCTUATION = re.compile(r"[!-/:-@\[-`{-~]")


def has_digit(word: str) -> bool:
    return any(c.isdigit() for c in word)


class Dialect:
    """The portable dialect (SQLite, and the base of the others): no estimates; words are
    matched by scanning."""

    # A word boundary in the database's regular expressions: Python's, through the REGEXP
    # function Django gives SQLite.
    word_boundary = r"\b"

    def escape_regex(self, text: str) -> str:
        return re.escape(text)

    def number_pattern(self, word: str) -> str:
        """A word with a digit as a whole word: "4242" finds "order 4242" and "INV-4242", not
        "14242" (a boundary where the word begins or ends with a letter, digit or _)."""
        left = self.word_boundary if _WORD_CHAR.match(word[0]) else ""
        right = self.word_boundary if _WORD_CHAR.match(word[-1]) else ""
        return left + self.escape_regex(word) + right

    def contains_words(
        self, queryset: QuerySet[Any], field: str, words: list[str]
    ) -> QuerySet[Any]:
        """The rows of ``queryset`` whose ``field`` holds every word, case-insensitively: a
        word with a digit (an order number, an id) as a whole word, any other word anywhere
        (a part of a word finds it)."""
        for word in words:
            if has_digit(word):
                queryset = queryset.filter(**{f"{field}__iregex": self.number_pattern(word)})
            else:
                queryset = queryset.filter(**{f"{field}__icontains": word})
        return queryset

    def task_words(self, queryset: QuerySet[Any], words: list[str]) -> QuerySet[Any]:
        """The runs of ``queryset`` whose task may hold every word, as an index narrows them
        (a superset: the caller checks the task with ``contains_words``). Without an index,
        every run is a candidate."""
        return queryset


class PostgresDialect(Dialect):
    word_boundary = r"\y"  # PostgreSQL's regular expressions: \b is a backspace there

    def escape_regex(self, text: str) -> str:
        # ASCII punctuation only: a backslash before a letter or digit is an escape in PG.
        return _PUNCTUATION.sub(r"\\\g<0>", text)

    def contains_words(
        self, queryset: QuerySet[Any], field: str, words: list[str]
    ) -> QuerySet[Any]:
        """As the portable dialect, in the forms a trigram index answers: ``~*`` (Django's
        iregex) and ILIKE."""
        like = connections[queryset.db].ops.prep_for_like_query
        for word in words:
            if has_digit(word):
                queryset = queryset.filter(**{f"{field}__iregex": self.number_pattern(word)})
            else:
                queryset = queryset.filter(ILike(F(field), Value(f"%{like(word)}%")))
        return queryset

    def task_words(self, queryset: QuerySet[Any], words: list[str]) -> QuerySet[Any]:
        """Through the trigram index on task steps (``agent_step_task_trgm``): the task step's
        payload is the task as a JSON string, so each word is looked up JSON-escaped. These are
        candidates: the caller checks the task itself (``_task_matches``), so that a word that
        only a JSON escape holds does not match. With ENCRYPTION_KEYS the task steps are
        ciphertext: every run is a candidate, and the caller's check of the task (a plain
        column) decides, by scanning."""
        if encryption.enabled():
            return super().task_words(queryset, words)
        escaped = [json.dumps(word, ensure_ascii=False)[1:-1] for word in words]
        step = self.contains_words(
            AgentStep.objects.filter(run_id=OuterRef("pk"), kind=StepKind.TASK), "payload", escaped
        )
        return queryset.filter(Exists(step))


def dialect(using: str = "default") -> Dialect:
    if connections[using].vendor == "postgresql":
        return PostgresDialect()
    return Dialect()


# -- counting and paging --------------------------------------------------------------------


class EstimatingPaginator(Paginator):  # type: ignore[type-arg]
    """Django's paginator for lists of millions: ``count`` is a ``bounded_count`` and the
    pages stop after EXACT_COUNT_LIMIT rows (no deep OFFSET)."""

    @cached_property
    def bounded(self) -> Count:
        queryset: QuerySet[Any] = self.object_list  # type: ignore[assignment]
        return bounded_count(queryset)

    @cached_property
    def count(self) -> int:
        return self.bounded.value

    @cached_property
    def num_pages(self) -> int:
        return min(super().num_pages, self.max_pages)

    @property
    def max_pages(self) -> int:
        return max(1, counting.EXACT_COUNT_LIMIT // self.per_page)

    @property
    def count_is_estimate(self) -> bool:
        return not self.bounded.exact

    @property
    def pages_end_early(self) -> bool:
        """Whether the list goes on past its last page link."""
        return not self.bounded.exact or self.bounded.value > self.max_pages * self.per_page


# -- filters --------------------------------------------------------------------------------


def distinct_values(
    queryset: QuerySet[Any], field: str, limit: int = MAX_FILTER_VALUES
) -> list[str]:
    """The distinct values of ``field`` in order, by a skip scan over an index led by it: one
    probe per value (a recursive CTE), not a scan of the table. At most ``limit`` values."""
    model = queryset.model
    connection = connections[queryset.db]
    quote = connection.ops.quote_name
    table = quote(model._meta.db_table)
    column = quote(model._meta.get_field(field).column)
    sql = (
        f"WITH RECURSIVE found(value) AS ("
        f" SELECT MIN({column}) FROM {table}"
        f" UNION ALL"
        f" SELECT (SELECT MIN({column}) FROM {table} WHERE {column} > found.value)"
        f" FROM found WHERE found.value IS NOT NULL"
        f") SELECT value FROM found WHERE value IS NOT NULL LIMIT %s"
    )
    with connection.cursor() as cursor:
        cursor.execute(sql, [limit])
        return [row[0] for row in cursor.fetchall()]


# -- search ---------------------------------------------------------------------------------


@dataclass
class SearchResult:
    queryset: QuerySet[Any]
    capped: bool = False  # more matches than MAX_SEARCH_MATCHES: the newest are shown
    short_words: list[str] | None = None  # words too short for the index, not searched


def _newest_ids(queryset: QuerySet[Any]) -> list[Any]:
    return list(
        queryset.order_by("-created_at").values_list("pk", flat=True)[: MAX_SEARCH_MATCHES + 1]
    )


def _task_matches(queryset: QuerySet[Any], words: list[str], words_of: Dialect) -> list[Any]:
    """The newest runs whose task holds every word, at most MAX_SEARCH_MATCHES + 1, in two
    steps. First the newest RECENT_WINDOW runs are read by creation (an index range) and
    their tasks matched one by one: a common word ends the search here, before an index
    lookup that would gather every one of its matches. Only when the window holds fewer than
    MAX_SEARCH_MATCHES does the word index (``Dialect.task_words``) look through the rest."""
    boundary = (
        queryset.order_by("-created_at").values_list("created_at", flat=True)[
            RECENT_WINDOW : RECENT_WINDOW + 1
        ]
    ).first()
    if boundary is None:  # the window is the whole list
        return _newest_ids(words_of.contains_words(queryset, "task", words))
    recent = _newest_ids(
        words_of.contains_words(queryset.filter(created_at__gt=boundary), "task", words)
    )
    if len(recent) > MAX_SEARCH_MATCHES:
        return recent
    # A word with a digit (an order number, an id) is far rarer than a word of the language:
    # the index looks up those alone when there are any, and the task check takes the rest.
    rare = [word for word in words if has_digit(word)] or words
    older = words_of.task_words(queryset.filter(created_at__lte=boundary), rare)
    older_ids = _newest_ids(words_of.contains_words(older, "task", words))
    # A fork forked past its task shares its parent's task step and holds none of its own:
    # the word index does not name it, so forks are matched on their task column (through the
    # partial index agent_run_forks), and both lists merged newest first.
    forks = queryset.filter(created_at__lte=boundary, forked_from__isnull=False)
    fork_ids = _newest_ids(words_of.contains_words(forks, "task", words))
    if fork_ids:
        older_ids = _newest_ids(queryset.filter(pk__in=older_ids + fork_ids))
    return recent + older_ids[: MAX_SEARCH_MATCHES + 1 - len(recent)]


# ``meta:key=value`` in the runs list's search: the runs whose metadata holds that value.
METADATA_PREFIX = "meta:"
_METADATA_TERM = re.compile(r"^meta:(?P<key>[^=\s]+)=(?P<value>\S*)$")


def metadata_terms(term: str) -> tuple[list[tuple[str, str]], str]:
    """The ``meta:key=value`` words of a search and what is left of it. A word that starts
    with ``meta:`` but has no ``=`` is an ordinary word."""
    pairs, rest = [], []
    for word in term.split():
        match = _METADATA_TERM.match(word)
        if match is None:
            rest.append(word)
        else:
            pairs.append((match["key"], match["value"]))
    return pairs, " ".join(rest)


def _metadata_value_match(vendor: str, key: str, value: str) -> Q:
    """``key=value`` as typed: the value as a string, and as the JSON scalar it spells too
    (``order=42`` finds 42 and "42"; ``vip=true`` finds true and "true"). Each a containment
    of its own on PostgreSQL, so that the index serves each."""
    found = metadata_match(vendor, {key: value})
    try:
        parsed = json.loads(value)
    except ValueError:
        return found
    if parsed is None or isinstance(parsed, (bool, int, float)):
        found |= metadata_match(vendor, {key: parsed})
    return found


def search_runs(queryset: QuerySet[AgentRun], term: str) -> SearchResult:
    """The runs of ``queryset`` (already filtered) that ``term`` names, each kind of term
    through its own index:

    - a whole run id: that run;
    - a request id (``req_...``, ``msg_...``) or its first characters: the runs that made the
      request (a step's request id), and dead or failed runs whose reason names it;
    - anything else, word by word (every word must match): runs whose task holds the words,
      dead or failed runs whose reason holds them, runs of an agent or model of that exact
      name, and, for a single run of hex digits, the runs whose id starts with it and the
      time-ordered run whose short id (the last 8 digits of its id) it is.

    ``meta:key=value`` words (``meta:tenant=acme``) keep the runs whose metadata has that
    value under that key (``with_metadata``: a containment the index ``agent_run_metadata``
    serves on PostgreSQL); the rest of the term, if any, is searched among those.

    Whatever the term, the run started with exactly that key is listed too (a key is often
    an id of the caller's: a ticket's, an order's, a request's UUID), and the runs of exactly
    that concurrency key (the index agent_run_key).

    The matches by words or request id are looked up first, the newest MAX_SEARCH_MATCHES of
    them (``capped`` says when there were more); the list then shows those. The key adds no
    query: it is one more condition of the list's own.
    """
    term = term.strip()
    pairs, rest = metadata_terms(term)
    if pairs:
        vendor = connections[queryset.db].vendor
        for key, value in pairs:
            queryset = queryset.filter(_metadata_value_match(vendor, key, value))
        if not rest:
            return SearchResult(queryset)
        term = rest
    by_key = Q(start_key=term) | Q(concurrency_key=term)
    try:
        return SearchResult(queryset.filter(Q(pk=uuid.UUID(term)) | by_key))
    except ValueError:
        pass
    if _REQUEST_ID.match(term):
        steps = AgentStep.objects.filter(request_id__startswith=term).values("run_id")
        made = _newest_ids(queryset.filter(pk__in=steps[: MAX_SEARCH_MATCHES + 1]))
        named = _newest_ids(queryset.filter(status__in=REASON_STATUSES, error__contains=term))
        ids = list(dict.fromkeys(made + named))[:MAX_SEARCH_MATCHES]
        capped = len(made) > MAX_SEARCH_MATCHES or len(named) > MAX_SEARCH_MATCHES
        return SearchResult(queryset.filter(Q(pk__in=ids) | by_key), capped=capped)
    words = term.split()
    short = [word for word in words if len(word) < MIN_WORD_CHARS]
    indexed = [word for word in words if len(word) >= MIN_WORD_CHARS]
    if not indexed:  # short words only: searched as they are (the index cannot help)
        indexed, short = words, []
    words_of = dialect(queryset.db)
    by_task = _task_matches(queryset, indexed, words_of)
    by_reason = _newest_ids(
        words_of.contains_words(queryset.filter(status__in=REASON_STATUSES), "error", indexed)
    )
    found = Q(pk__in=list(dict.fromkeys(by_task + by_reason))[:MAX_SEARCH_MATCHES]) | by_key
    if len(words) == 1:
        found |= Q(agent=term) | Q(model=term)
        by_id = short_id_match(term)
        if by_id is not None:
            found |= by_id
    capped = len(by_task) > MAX_SEARCH_MATCHES or len(by_reason) > MAX_SEARCH_MATCHES
    return SearchResult(
        queryset.filter(found),
        capped=capped,
        short_words=short or None,
    )


def search_note(result: SearchResult) -> str:
    """What the page says about a search that was narrowed, or ''."""
    notes = []
    if result.capped:
        notes.append(
            gettext(
                "Only the newest %(count)s matches of the search are listed: add words to "
                "narrow it."
            )
            % {"count": intcomma(MAX_SEARCH_MATCHES)}
        )
    if result.short_words:
        notes.append(
            ngettext(
                "The word %(words)s is too short to search for and was left out.",
                "The words %(words)s are too short to search for and were left out.",
                len(result.short_words),
            )
            % {"words": ", ".join(f"“{w}”" for w in result.short_words)}
        )
    return " ".join(notes)
