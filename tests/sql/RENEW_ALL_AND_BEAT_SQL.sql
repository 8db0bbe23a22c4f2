
WITH
present AS (
    INSERT INTO agent_worker AS worker
           (id, instance, host, pid, started_at, beat_at, alive_until, concurrency,
            runs_held, draining, versions)
    VALUES (%(owner)s, %(instance)s, %(host)s, %(pid)s, now(), now(),
            now() + make_interval(secs => %(alive)s), %(concurrency)s, %(runs_held)s,
            %(draining)s, %(versions)s::jsonb)
    ON CONFLICT (id) DO UPDATE
       SET beat_at = now(),
           alive_until = EXCLUDED.alive_until,
           runs_held = EXCLUDED.runs_held,
           draining = EXCLUDED.draining
     WHERE worker.instance = EXCLUDED.instance
), held AS (
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