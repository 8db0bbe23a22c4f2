
WITH held AS (
    SELECT * FROM unnest(%(ids)s::uuid[], %(attempts)s::integer[]) AS held(id, attempt)
), renewed AS (
    UPDATE agent_run AS run
       SET lease_until = now() + make_interval(secs => %(lease)s),
           updated_at = now()
      FROM held
     WHERE run.id = held.id
       AND run.attempt = held.attempt
       AND run.lease_owner = %(owner)s
       AND run.status = 'running'
 RETURNING run.id
)
SELECT run.id, run.status
  FROM agent_run AS run
 WHERE run.id = ANY(%(ids)s::uuid[])
   AND run.id NOT IN (SELECT id FROM renewed)
   FOR SHARE OF run