
SELECT EXTRACT(EPOCH FROM wake_at - now())::float8
  FROM agent_run
 WHERE status = 'waiting' AND wake_at IS NOT NULL
 ORDER BY wake_at
 LIMIT 1