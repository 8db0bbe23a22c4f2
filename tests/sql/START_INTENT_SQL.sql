
WITH fence AS (
    UPDATE agent_run
       SET lease_until = now() + make_interval(secs => %(lease)s),
           updated_at = now()
     WHERE id = %(run_id)s
       AND lease_owner = %(owner)s
       AND attempt = %(attempt)s
       AND status = 'running'
 RETURNING id
)
UPDATE tool_intent
   SET status = 'executing', updated_at = now()
 WHERE id = %(intent_id)s
   AND status = 'approved'
   AND EXISTS (SELECT 1 FROM fence)
RETURNING id