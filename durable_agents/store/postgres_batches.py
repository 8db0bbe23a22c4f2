"""Batched model turns on PostgreSQL: the fenced wake of a chunk of answered runs in one
statement (``WAKE_ANSWERED_SQL``), where the ORM sends one UPDATE per answer.

Each answer's run is found by its primary key (the join on ``r.id``), then fenced as the ORM's
UPDATE fences it: still waiting, on a batched turn, on that request, at that position. A run
whose fence fails is left alone; the caller counts its answer as paid and ignored.
"""

from __future__ import annotations

from collections.abc import Sequence

from django.db import connection

from durable_agents.models import AgentRun
from durable_agents.store.batches import Candidate

WAKE_ANSWERED_SQL = """\
UPDATE agent_run AS r
   SET status = 'pending',
       last_seq = a.seq,
       stalled_claims = 0,
       lease_owner = NULL,
       lease_until = NULL,
       wait_key = NULL,
       woken_by = %(woken_by)s,
       updated_at = now(),
       tokens_used = r.tokens_used + a.tokens,
       cost_usd = CASE WHEN a.cost IS NULL THEN r.cost_usd
                       ELSE coalesce(r.cost_usd + a.cost, a.cost) END
  FROM unnest(%(request_ids)s::bigint[], %(run_ids)s::uuid[], %(seqs)s::integer[],
              %(tokens)s::bigint[], %(costs)s::numeric[])
       AS a(request_id, run_id, seq, tokens, cost)
 WHERE r.id = a.run_id
   AND r.status = 'waiting'
   AND r.waiting_for = 'batch'
   AND r.wait_key = a.request_id::text
   AND r.last_seq = a.seq - 1
RETURNING a.request_id"""


def wake_answers(candidates: Sequence[Candidate], woken_by: str) -> set[int]:
    """``PostgresStore.wake_batch_answers``: ``WAKE_ANSWERED_SQL``; the request ids it woke."""
    field = AgentRun._meta.get_field("woken_by")
    params = {
        "woken_by": field.get_db_prep_save(woken_by, connection),
        "request_ids": [c.request.pk for c in candidates],
        "run_ids": [c.request.run_id for c in candidates],
        "seqs": [c.request.seq for c in candidates],
        "tokens": [c.answer.tokens for c in candidates],
        "costs": [c.cost for c in candidates],
    }
    with connection.cursor() as cursor:
        cursor.execute(WAKE_ANSWERED_SQL, params)
        return {int(row[0]) for row in cursor.fetchall()}
