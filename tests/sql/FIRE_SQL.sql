WITH slot AS (
    SELECT *
      FROM jsonb_to_recordset(%(slots)s::jsonb)
           AS s(n int, run_id uuid, template int, task text, start_key text, priority smallint,
                concurrency_key text, payload text)
), template AS (
    SELECT * FROM jsonb_populate_recordset(NULL::agent_run, %(templates)s::jsonb)
           WITH ORDINALITY AS t
), wanted AS (
    SELECT concurrency_key AS key, count(*) AS runs
      FROM slot
     WHERE concurrency_key IS NOT NULL
     GROUP BY concurrency_key
), turn AS (
    -- As for one run at a time: a key's runs take its turns one after the other.
    INSERT INTO agent_concurrency_key AS k (key, next_fair_at)
    SELECT key, now() + runs * %(spacing)s FROM wanted
        ON CONFLICT (key) DO UPDATE
       SET next_fair_at = GREATEST(k.next_fair_at, now()) + (excluded.next_fair_at - now())
    RETURNING k.key, k.next_fair_at
), fair AS (
    SELECT s.n,
           turn.next_fair_at - (wanted.runs + 1
               - row_number() OVER (PARTITION BY s.concurrency_key ORDER BY s.n))
               * %(spacing)s AS fair_at
      FROM slot AS s
      JOIN turn ON turn.key = s.concurrency_key
      JOIN wanted ON wanted.key = s.concurrency_key
), started AS (
    INSERT INTO agent_run (id,
                           agent,
                           prompt_version,
                           fingerprint,
                           model,
                           task,
                           status,
                           lease_owner,
                           lease_until,
                           attempt,
                           stalled_claims,
                           last_seq,
                           tokens_used,
                           cost_usd,
                           result,
                           output,
                           error,
                           dead_cause,
                           started_at,
                           finished_at,
                           waiting_for,
                           waiting_since,
                           wake_at,
                           wait_event,
                           wait_runs,
                           wait_key,
                           woken_by,
                           parent_id,
                           spawn_key,
                           root_id,
                           depth,
                           priority,
                           trace_context,
                           start_key,
                           concurrency_key,
                           concurrency_limit,
                           fair_at,
                           forked_from_id,
                           fork_seq,
                           fork_key_run_id,
                           metadata,
                           batch)
    SELECT s.run_id,
           t.agent,
           t.prompt_version,
           t.fingerprint,
           t.model,
           s.task,
           t.status,
           t.lease_owner,
           t.lease_until,
           t.attempt,
           t.stalled_claims,
           t.last_seq,
           t.tokens_used,
           t.cost_usd,
           t.result,
           t.output,
           t.error,
           t.dead_cause,
           t.started_at,
           t.finished_at,
           t.waiting_for,
           t.waiting_since,
           t.wake_at,
           t.wait_event,
           t.wait_runs,
           t.wait_key,
           t.woken_by,
           t.parent_id,
           t.spawn_key,
           t.root_id,
           t.depth,
           s.priority,
           t.trace_context,
           s.start_key,
           s.concurrency_key,
           t.concurrency_limit,
           COALESCE(f.fair_at, now()),
           t.forked_from_id,
           t.fork_seq,
           t.fork_key_run_id,
           t.metadata,
           t.batch
      FROM slot AS s
      JOIN template AS t ON t.ordinality = s.template
      LEFT JOIN fair AS f ON f.n = s.n
     ORDER BY s.n
        ON CONFLICT DO NOTHING
    RETURNING id
), task_step AS (
    INSERT INTO agent_step (run_id, seq, part, kind, payload, attempt, worker)
    SELECT s.run_id, 0, CASE WHEN substr(s.run_id::text, 15, 1) = '7' AND substr(s.run_id::text, 20, 1) IN ('8', '9', 'a', 'b') THEN (('x' || translate(left(s.run_id::text, 13), '-', ''))::bit(48)::bigint / 86400000)::integer ELSE 0 END, 'task', s.payload, 0, ''
      FROM slot AS s
      JOIN started ON started.id = s.run_id
), stored AS (
    -- The slot's run: the one just started, or the one that had its key already.
    SELECT s.n, s.start_key, COALESCE(started.id, had.id) AS run_id
      FROM slot AS s
      JOIN template AS t ON t.ordinality = s.template
      LEFT JOIN started ON started.id = s.run_id
      LEFT JOIN agent_run AS had ON had.agent = t.agent AND had.start_key = s.start_key
), moved AS (
    UPDATE agent_schedule AS sc
       SET next_slot = m.next_slot,
           last_slot = COALESCE(m.last_slot, sc.last_slot),
           last_run_id = CASE WHEN m.last_key IS NULL THEN sc.last_run_id
                              ELSE (SELECT run_id FROM stored WHERE start_key = m.last_key)
                         END,
           broken = m.broken,
           updated_at = now()
      FROM jsonb_to_recordset(%(moves)s::jsonb)
           AS m(id bigint, next_slot timestamptz, last_slot timestamptz, last_key text,
                broken text)
     WHERE sc.id = m.id
)
SELECT start_key, run_id FROM stored ORDER BY n