
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
UPDATE agent_run AS run
   SET status = 'running',
       lease_owner = %(owner)s,
       lease_until = now() + make_interval(secs => %(lease)s),
       attempt = run.attempt + 1,
       stalled_claims = run.stalled_claims + 1,
       started_at = coalesce(run.started_at, now()),
       -- A due wait: what ended it. Any other run keeps its own (a crash after a wake).
       woken_by = CASE WHEN run.status <> 'waiting' THEN run.woken_by
                       WHEN run.waiting_for = 'timer' THEN '{"timer": true}'
                       ELSE '{"timeout": true}' END,
       wake_at = NULL,
       updated_at = now()
 WHERE run.id IN (SELECT id FROM (SELECT id FROM due UNION ALL SELECT id FROM ready) AS claimable
                   LIMIT %(limit)s)
RETURNING run.*,
          -- A run with nothing but its task: its log comes with the claim (no second read).
          (SELECT payload FROM agent_step
            WHERE run_id = run.id AND seq = 0 AND kind = 'task' AND run.last_seq = 0
          ) AS task_payload