
WITH due AS (
SELECT id FROM agent_run
 WHERE status = 'waiting'
   AND wake_at <= now()
 ORDER BY wake_at
 LIMIT %(limit)s
   FOR NO KEY UPDATE SKIP LOCKED
), ready AS (
SELECT id FROM agent_run
 WHERE status IN ('pending', 'running')
   AND (lease_until IS NULL OR lease_until < now())
 ORDER BY priority DESC, created_at
 LIMIT greatest(%(limit)s - (SELECT count(*) FROM due), 0)
   FOR NO KEY UPDATE SKIP LOCKED
)
SELECT id FROM due UNION ALL SELECT id FROM ready