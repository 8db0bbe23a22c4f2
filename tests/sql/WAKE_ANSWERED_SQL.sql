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
RETURNING a.request_id