"""Concurrency keys: at most a key's limit of runs with one key running at once, fleet-wide,
and claims fair across keys within a priority. What every store shares about them.

``start_run(..., concurrency_key="tenant:acme")`` gives a run a key (a child run gets its
parent's). The key's limit is ``CONCURRENCY_LIMITS[key]`` if set, else the ``concurrency_limit``
the run's agent had when the run started (``AgentRun.concurrency_limit``), else none. A run
*holds* one of its key's slots while it is running with a live lease; a pending or waiting run
holds nothing, and a run whose worker died stops holding when its lease runs out (its count
leaves the key then, and the run is claimable again). A limit of 0 holds the key's runs pending.

Enforced by the claim, and nowhere else: no status transition (finish, park, release, cancel,
dead letter, requeue, lease expiry) has anything to update, because nothing is counted ahead
of time. A claim counts the key's holders at the moment it takes a run:

    held(key) = running runs of the key with lease_until >= now()   (agent_run_key_running)

Why that count is race-free, on PostgreSQL under READ COMMITTED with SKIP LOCKED. A plain
``count(*) < limit`` in the claim statement races: the count reads the statement's snapshot,
so two workers claiming runs of one key at the same instant both count the same holders and
both take a run. Locking something first does not help by itself: a subquery is not read
again after the statement waited for a lock. So each key has a row (``agent_concurrency_key``,
written when a keyed run is created) and a claim of its runs

1. selects its candidates in claim order, skipping a key whose count, on the statement's
   snapshot, is at its limit already (a cheap filter: it may be stale, never too strict for
   long),
2. locks the rows of the candidates' keys, in key order (no deadlock between two claims that
   want the same keys), FOR NO KEY UPDATE, and waits for a claim that holds one,
3. takes a key's candidates only if ``agent_concurrency_held(key) + candidates <= limit``,
   counted by a VOLATILE function, which in READ COMMITTED counts on a fresh snapshot of its
   own each time it is called,
4. updates the row of every key it took runs of (``claimed_at``), in the same statement.

A claim that found the row locked by another claim waits for that claim's commit; the row was
updated, so PostgreSQL evaluates the lock's condition again on the new row version
(EvalPlanQual), which calls the function again, and the fresh count includes the runs the
other claim took. A claim that did not take runs of the key does not update its row: nothing
changed for the waiter to see. So every claim of a key's runs counts every earlier committed
claim of them: no two claims of one key can both take its last slot. Ends, parks and releases
only lower the count; a claim that counted a run just before it ended is stricter than needed,
once, never looser. The claim indexes stay as they were (the filter of step 1 reads the index
``agent_run_key_running`` once per candidate key).

The alternatives, and why not: a per-key counter, incremented by the claim and decremented by
every other transition, must be kept right by each of a dozen statements (and by housekeeping
when a worker dies: a dead worker's run keeps its slot until something notices the lease ran
out), and drifts with every one that forgets; per-key slot rows need their own leases, renewed
by every heartbeat. Counting the runs themselves has nothing to drift: the lease that frees a
dead worker's run frees its slot, at the same instant. A claim that lost the race for a key
(the fresh count said no) may come back with fewer runs than it could have taken;
``PostgresStore.claim_runs`` then claims again. On SQLite the IMMEDIATE transaction makes the
count and the take one exclusive step; ``PortableStore`` on PostgreSQL locks the key rows and
then counts in a statement of its own (a fresh snapshot). The one gap: a worker that outlived
its lease without anyone taking the run over (a stall longer than LEASE_SECONDS) renews it at
its next heartbeat or commit, and for that moment its key may have one run more than its
limit.

Fair share: within a priority a claim takes the earliest ``fair_at`` first (then the oldest). A
run without a key has its creation as its turn, so without keys the order is the one of
before. A keyed run's turn is ``FAIR_SPACING`` after the previous run of its key, or its
creation if that is later: a key that queues 1,000 runs at once has them spread over 1,000
seconds of turns, and a key that starts 10 runs a little later gets turns among the first of
them, instead of after the 1,000. A run's turn never comes after a run created after its turn,
so no run starves. The turn is computed when the run is created, under the key's row lock
(``ConcurrencyKey.next_fair_at``), so the claim stays one ordered index read.
"""

from __future__ import annotations

import datetime
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

from durable_agents._internal.text import has_unstorable
from durable_agents.conf import app_settings
from durable_agents.exceptions import InvalidArgument
from durable_agents.models import MAX_CONCURRENCY_KEY, AgentRun

# How far apart the turns of one key's runs are (see the module docstring).
FAIR_SPACING = datetime.timedelta(seconds=1)


def check_concurrency_key(key: object) -> None:
    """A concurrency key is a non-empty string of at most 200 characters without NUL or lone
    surrogates; anything else is an ``InvalidArgument`` (a ``ValueError``)."""
    if not isinstance(key, str):
        raise InvalidArgument(f"a concurrency key is a string, not {type(key).__name__}")
    if not key:
        raise InvalidArgument("a concurrency key cannot be empty")
    if key.isspace():
        # Blank to whoever reads the list of keys, and one apart from another by a space it
        # cannot see: such a key names no tenant or customer.
        raise InvalidArgument("a concurrency key cannot be only whitespace")
    if len(key) > MAX_CONCURRENCY_KEY:
        raise InvalidArgument(
            f"a concurrency key has at most {MAX_CONCURRENCY_KEY} characters; "
            f"this one has {len(key)}"
        )
    if has_unstorable(key):
        raise InvalidArgument("a concurrency key cannot contain NUL characters or lone surrogates")


def overrides() -> dict[str, int]:
    """``CONCURRENCY_LIMITS`` as the claim uses it: entries the system checks would refuse are
    left out (they are reported at start-up; a claim never fails on them)."""
    limits: Any = app_settings.CONCURRENCY_LIMITS
    if not isinstance(limits, Mapping):
        return {}
    return {
        key: value
        for key, value in limits.items()
        if isinstance(key, str)
        and key
        and isinstance(value, int)
        and not isinstance(value, bool)
        and value >= 0
    }


def limit_of(key: str | None, pinned: int | None, limits: Mapping[str, int]) -> int | None:
    """The limit of a run with ``key`` whose agent's limit was ``pinned``: the setting's for
    the key, else the agent's, else None (no limit, as for a run without a key)."""
    if key is None:
        return None
    return limits.get(key, pinned)


def admit(
    runs: Iterable[AgentRun], held: Mapping[str, int], limits: Mapping[str, int], limit: int
) -> list[AgentRun]:
    """Of ``runs``, in their claim order, the first ``limit`` a claim may take when the keys'
    holders are ``held``: a keyed run only while its key stays within its limit, counting the
    runs taken before it here."""
    taken: list[AgentRun] = []
    more: Counter[str] = Counter()
    for run in runs:
        if len(taken) >= limit:
            break
        key = run.concurrency_key
        cap = limit_of(key, run.concurrency_limit, limits)
        if key is not None:
            if cap is not None and held.get(key, 0) + more[key] >= cap:
                continue
            more[key] += 1
        taken.append(run)
    return taken


def next_turn(
    now: datetime.datetime, next_fair_at: datetime.datetime | None
) -> tuple[datetime.datetime, datetime.datetime]:
    """A keyed run's turn created at ``now`` when its key's next turn is ``next_fair_at``,
    and the key's next turn after it (the in-memory store's; the database stores compute the
    same in SQL)."""
    turn = now if next_fair_at is None or next_fair_at < now else next_fair_at
    return turn, turn + FAIR_SPACING
