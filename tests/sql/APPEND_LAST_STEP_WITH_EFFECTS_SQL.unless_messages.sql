WITH fence AS (
    UPDATE agent_run
       SET last_seq = %(seq)s,
           stalled_claims = 0,
           tokens_used = tokens_used + %(tokens)s,
           cost_usd = coalesce(cost_usd + %(cost)s::numeric, %(cost)s::numeric, cost_usd),
           status = %(status)s,
           result = %(result)s,
           output = %(output)s,
           error = '',
           lease_owner = NULL,
           lease_until = NULL,
           finished_at = now(),
           updated_at = now()
     WHERE id = %(run_id)s
       AND lease_owner = %(owner)s
       AND attempt = %(attempt)s
       AND status = 'running'
       AND last_seq = %(seq)s - 1
       AND NOT EXISTS (SELECT 1 FROM agent_message
                        WHERE run_id = %(run_id)s AND folded_seq IS NULL)
 RETURNING id, agent, model, concurrency_key
),
recorded AS (
    INSERT INTO tool_effect (key, run_id, seq, call_index, tool, result, is_error)
    VALUES {rows}
    ON CONFLICT (key) DO NOTHING
)
INSERT INTO agent_step (run_id, seq, part, kind, payload, content_start, content_end,
                        request_id, attempt, worker)
SELECT id, %(seq)s, %(part)s, %(kind)s, %(payload)s, %(content_start)s, %(content_end)s,
       %(request_id)s, %(attempt)s, %(owner)s
  FROM fence