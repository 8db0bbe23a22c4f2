
WITH due AS (
SELECT id, concurrency_key, coalesce((%(limit_values)s::integer[])[array_position(%(limit_keys)s::text[], run.concurrency_key)], run.concurrency_limit) AS key_limit,
       CASE WHEN concurrency_key IS NULL THEN 0 ELSE agent_concurrency_holders(run.concurrency_key) END AS held,
       0 AS part, wake_at AS due_at, priority, fair_at, created_at
  FROM agent_run AS run
 WHERE status = 'waiting'
   AND wake_at <= now()
   AND (run.concurrency_key IS NULL
        OR coalesce((%(limit_values)s::integer[])[array_position(%(limit_keys)s::text[], run.concurrency_key)], run.concurrency_limit) IS NULL
        OR coalesce((%(limit_values)s::integer[])[array_position(%(limit_keys)s::text[], run.concurrency_key)], run.concurrency_limit) > agent_concurrency_holders(run.concurrency_key))
   AND (run.agent || chr(31) || run.prompt_version) = ANY(%(serves)s::text[])
   AND NOT (run.agent || chr(31) || run.prompt_version || chr(31) || run.fingerprint) = ANY(%(refuses)s::text[])
 ORDER BY wake_at
 LIMIT %(limit)s
   FOR NO KEY UPDATE SKIP LOCKED
), ready AS (
SELECT id, concurrency_key, coalesce((%(limit_values)s::integer[])[array_position(%(limit_keys)s::text[], run.concurrency_key)], run.concurrency_limit) AS key_limit,
       CASE WHEN concurrency_key IS NULL THEN 0 ELSE agent_concurrency_holders(run.concurrency_key) END AS held,
       1 AS part, NULL::timestamptz AS due_at, priority, fair_at, created_at
  FROM agent_run AS run
 WHERE status IN ('pending', 'running')
   AND (lease_until IS NULL OR lease_until < now())
   AND (run.concurrency_key IS NULL
        OR coalesce((%(limit_values)s::integer[])[array_position(%(limit_keys)s::text[], run.concurrency_key)], run.concurrency_limit) IS NULL
        OR coalesce((%(limit_values)s::integer[])[array_position(%(limit_keys)s::text[], run.concurrency_key)], run.concurrency_limit) > agent_concurrency_holders(run.concurrency_key))
   AND (run.agent || chr(31) || run.prompt_version) = ANY(%(serves)s::text[])
   AND NOT (run.agent || chr(31) || run.prompt_version || chr(31) || run.fingerprint) = ANY(%(refuses)s::text[])
 ORDER BY priority DESC, fair_at, created_at
 LIMIT greatest(%(limit)s - (SELECT count(*) FROM due), 0)
   FOR NO KEY UPDATE SKIP LOCKED
)
SELECT id FROM due UNION ALL SELECT id FROM ready