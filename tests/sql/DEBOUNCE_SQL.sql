WITH pushed AS (
UPDATE agent_run
   SET wake_at = now() + make_interval(secs => %(seconds)s),
       waiting_since = now(),
       updated_at = now(),
       task = %(task)s,
       prompt_version = %(prompt_version)s,
       model = %(model)s,
       fingerprint = %(fingerprint)s,
       priority = %(priority)s,
       concurrency_key = %(concurrency_key)s,
       concurrency_limit = %(concurrency_limit)s,
       trace_context = %(trace_context)s,
       metadata = %(metadata)s,
       batch = %(batch)s
 WHERE start_key = %(start_key)s
   AND agent = %(agent)s
   AND status = 'waiting'
   AND waiting_for = 'debounce'
RETURNING id
), task_step AS (
UPDATE agent_step
   SET payload = %(payload)s
 WHERE run_id = (SELECT id FROM pushed)
   AND seq = 0
   AND kind = 'task'
)
SELECT id FROM pushed