
WITH run AS (
    UPDATE agent_run
       SET tokens_used = tokens_used + %(tokens)s,
           cost_usd = coalesce(cost_usd + %(cost)s::numeric, %(cost)s::numeric, cost_usd)
     WHERE id = %(run_id)s
 RETURNING id, agent, model, concurrency_key
)
INSERT INTO agent_usage_day AS used (day, concurrency_key, agent, model, shard, turns,
                                     input_tokens, output_tokens, cache_read_tokens,
                                     cache_write_tokens, cost_usd)
SELECT (now() AT TIME ZONE 'UTC')::date, coalesce(concurrency_key, ''), agent, model,
       %(shard)s, 1,
       %(input_tokens)s, %(output_tokens)s, %(cache_read_tokens)s, %(cache_write_tokens)s,
       %(cost)s::numeric
  FROM run
    ON CONFLICT (day, concurrency_key, agent, model, shard) DO UPDATE
   SET turns = used.turns + 1,
       input_tokens = used.input_tokens + EXCLUDED.input_tokens,
       output_tokens = used.output_tokens + EXCLUDED.output_tokens,
       cache_read_tokens = used.cache_read_tokens + EXCLUDED.cache_read_tokens,
       cache_write_tokens = used.cache_write_tokens + EXCLUDED.cache_write_tokens,
       cost_usd = coalesce(used.cost_usd + EXCLUDED.cost_usd, EXCLUDED.cost_usd, used.cost_usd)