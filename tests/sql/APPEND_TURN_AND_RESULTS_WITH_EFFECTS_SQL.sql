WITH fence AS (
    UPDATE agent_run
       SET last_seq = %(results_seq)s,
           stalled_claims = 0,
           tokens_used = tokens_used + %(tokens)s,
           cost_usd = coalesce(cost_usd + %(cost)s::numeric, %(cost)s::numeric, cost_usd),
           lease_until = now() + make_interval(secs => %(lease)s),
           updated_at = now()
     WHERE id = %(run_id)s
       AND lease_owner = %(owner)s
       AND attempt = %(attempt)s
       AND status = 'running'
       AND last_seq = %(seq)s - 1
 RETURNING id, agent, model, concurrency_key
),
usage AS (
    INSERT INTO agent_usage_day AS used (day, concurrency_key, agent, model, shard, turns,
                                         input_tokens, output_tokens, cache_read_tokens,
                                         cache_write_tokens, cost_usd)
    SELECT (now() AT TIME ZONE 'UTC')::date, coalesce(concurrency_key, ''), agent, model,
           %(shard)s, 1,
           %(input_tokens)s, %(output_tokens)s, %(cache_read_tokens)s, %(cache_write_tokens)s,
           %(cost)s::numeric
      FROM fence
        ON CONFLICT (day, concurrency_key, agent, model, shard) DO UPDATE
       SET turns = used.turns + 1,
           input_tokens = used.input_tokens + EXCLUDED.input_tokens,
           output_tokens = used.output_tokens + EXCLUDED.output_tokens,
           cache_read_tokens = used.cache_read_tokens + EXCLUDED.cache_read_tokens,
           cache_write_tokens = used.cache_write_tokens + EXCLUDED.cache_write_tokens,
           cost_usd = coalesce(used.cost_usd + EXCLUDED.cost_usd, EXCLUDED.cost_usd, used.cost_usd)
),
recorded AS (
    INSERT INTO tool_effect (key, run_id, seq, call_index, tool, result, is_error)
    SELECT effect.key, fence.id, effect.seq, effect.call_index, effect.tool, effect.result,
           effect.is_error
      FROM fence, (VALUES {rows}) AS effect (key, seq, call_index, tool, result, is_error)
    ON CONFLICT (key) DO NOTHING
)
INSERT INTO agent_step (run_id, seq, part, kind, payload, content_start, content_end,
                        request_id, attempt, worker)
SELECT id, %(seq)s, %(part)s, %(kind)s, %(payload)s, %(content_start)s, %(content_end)s,
       %(request_id)s, %(attempt)s, %(owner)s
  FROM fence
UNION ALL
SELECT id, %(results_seq)s, %(part)s, %(results_kind)s, %(results_payload)s, NULL::integer,
       NULL::integer, NULL::text, %(attempt)s, %(owner)s
  FROM fence