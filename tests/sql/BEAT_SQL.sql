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
)
SELECT 1