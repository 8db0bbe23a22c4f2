UPDATE agent_schedule AS s
   SET next_slot = v.next_slot, last_slot = v.last_slot, last_run_id = v.last_run_id,
       broken = v.broken, updated_at = now()
  FROM unnest(%s::bigint[], %s::timestamptz[], %s::timestamptz[], %s::uuid[], %s::text[])
       AS v(id, next_slot, last_slot, last_run_id, broken)
 WHERE s.id = v.id