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
), usage AS (
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
), appended AS (
INSERT INTO agent_step (run_id, seq, part, kind, payload, content_start, content_end,
                        request_id, attempt, worker)
SELECT id, %(seq)s, %(part)s, %(kind)s, %(payload)s, %(content_start)s, %(content_end)s,
       %(request_id)s, %(attempt)s, %(owner)s
  FROM fence
 RETURNING run_id
), due AS (
SELECT id, concurrency_key, coalesce((%(limit_values)s::integer[])[array_position(%(limit_keys)s::text[], run.concurrency_key)], run.concurrency_limit) AS key_limit,
       CASE WHEN concurrency_key IS NULL THEN 0 ELSE agent_concurrency_holders(run.concurrency_key) - (SELECT count(*) FROM fence WHERE fence.concurrency_key = run.concurrency_key) END AS held,
       0 AS part, wake_at AS due_at, priority, fair_at, created_at
  FROM agent_run AS run
 WHERE status = 'waiting'
   AND wake_at <= now()
   AND EXISTS (SELECT 1 FROM fence)
   AND (run.concurrency_key IS NULL
        OR coalesce((%(limit_values)s::integer[])[array_position(%(limit_keys)s::text[], run.concurrency_key)], run.concurrency_limit) IS NULL
        OR coalesce((%(limit_values)s::integer[])[array_position(%(limit_keys)s::text[], run.concurrency_key)], run.concurrency_limit) > agent_concurrency_holders(run.concurrency_key) - (SELECT count(*) FROM fence WHERE fence.concurrency_key = run.concurrency_key))
   AND (run.agent || chr(31) || run.prompt_version) = ANY(%(serves)s::text[])
   AND NOT (run.agent || chr(31) || run.prompt_version || chr(31) || run.fingerprint) = ANY(%(refuses)s::text[])
 ORDER BY wake_at
 LIMIT %(limit)s
   FOR NO KEY UPDATE SKIP LOCKED
), ready AS (
SELECT id, concurrency_key, coalesce((%(limit_values)s::integer[])[array_position(%(limit_keys)s::text[], run.concurrency_key)], run.concurrency_limit) AS key_limit,
       CASE WHEN concurrency_key IS NULL THEN 0 ELSE agent_concurrency_holders(run.concurrency_key) - (SELECT count(*) FROM fence WHERE fence.concurrency_key = run.concurrency_key) END AS held,
       1 AS part, NULL::timestamptz AS due_at, priority, fair_at, created_at
  FROM agent_run AS run
 WHERE status IN ('pending', 'running')
   AND (lease_until IS NULL OR lease_until < now())
   AND EXISTS (SELECT 1 FROM fence)
   AND (run.concurrency_key IS NULL
        OR coalesce((%(limit_values)s::integer[])[array_position(%(limit_keys)s::text[], run.concurrency_key)], run.concurrency_limit) IS NULL
        OR coalesce((%(limit_values)s::integer[])[array_position(%(limit_keys)s::text[], run.concurrency_key)], run.concurrency_limit) > agent_concurrency_holders(run.concurrency_key) - (SELECT count(*) FROM fence WHERE fence.concurrency_key = run.concurrency_key))
   AND (run.agent || chr(31) || run.prompt_version) = ANY(%(serves)s::text[])
   AND NOT (run.agent || chr(31) || run.prompt_version || chr(31) || run.fingerprint) = ANY(%(refuses)s::text[])
 ORDER BY priority DESC, fair_at, created_at
 LIMIT greatest(%(limit)s - (SELECT count(*) FROM due), 0)
   FOR NO KEY UPDATE SKIP LOCKED
),
claimable AS (
SELECT id, concurrency_key, key_limit
  FROM (SELECT *, row_number() OVER (PARTITION BY concurrency_key
                                     ORDER BY part, due_at, priority DESC, fair_at, created_at
                                    ) AS nth
          FROM (SELECT * FROM due UNION ALL SELECT * FROM ready) AS locked) AS ranked
 WHERE concurrency_key IS NULL OR key_limit IS NULL OR held + nth <= key_limit
 LIMIT %(limit)s
), wanted AS (
SELECT concurrency_key, count(*) AS runs, min(key_limit) AS key_limit
  FROM claimable
 WHERE concurrency_key IS NOT NULL
 GROUP BY concurrency_key
), admitted AS (
SELECT k.key
  FROM agent_concurrency_key AS k JOIN wanted ON wanted.concurrency_key = k.key
 WHERE wanted.key_limit IS NULL
    OR agent_concurrency_held(k.key) + wanted.runs <= wanted.key_limit
 ORDER BY k.key
   FOR NO KEY UPDATE OF k
), served AS (
UPDATE agent_concurrency_key SET claimed_at = now() WHERE key IN (SELECT key FROM admitted)
), taken AS (
UPDATE agent_run AS run
   SET status = 'running',
       lease_owner = %(owner)s,
       lease_until = now() + make_interval(secs => %(lease)s),
       attempt = run.attempt + 1,
       stalled_claims = run.stalled_claims + 1,
       started_at = coalesce(run.started_at, now()),
       -- A due wait: what ended it. Any other run keeps its own (a crash after a wake).
       -- A debounced start (its quiet window is over) is no wake of a call: NULL.
       woken_by = CASE WHEN run.status <> 'waiting' THEN run.woken_by
                       WHEN run.waiting_for = 'debounce' THEN NULL
                       WHEN run.waiting_for = 'timer' THEN '{"timer": true}'
                       ELSE '{"timeout": true}' END,
       wake_at = NULL,
       updated_at = now()
 WHERE run.id IN (SELECT id FROM claimable
                   WHERE concurrency_key IS NULL
                      OR concurrency_key IN (SELECT key FROM admitted))
RETURNING run.*,
          -- A run with nothing but its task: its log comes with the claim (no second read).
          -- Read only from the partitions of yesterday to tomorrow (bounds PostgreSQL prunes
          -- before it runs the statement, where the run's own day it cannot): the task of a
          -- run started earlier is read with its log instead (NULL here).
          (SELECT payload FROM agent_step
            WHERE run_id = run.id AND seq = 0 AND kind = 'task' AND run.last_seq = 0
              AND part = CASE WHEN substr(run.id::text, 15, 1) = '7' AND substr(run.id::text, 20, 1) IN ('8', '9', 'a', 'b') THEN (('x' || translate(left(run.id::text, 13), '-', ''))::bit(48)::bigint / 86400000)::integer ELSE 0 END
              AND part BETWEEN %(recent_from)s AND %(recent_to)s
          ) AS task_payload,
          -- Whether a message waits in its inbox: the look before its first model call,
          -- made by the claim (an index probe of agent_message_waiting) instead of a
          -- statement of its own.
          EXISTS (SELECT 1 FROM agent_message AS message
                   WHERE message.run_id = run.id AND message.folded_seq IS NULL
          ) AS messages_waiting
)
SELECT (SELECT count(*) FROM appended) AS appended, taken.*
  FROM (SELECT 1) AS one LEFT JOIN taken ON true