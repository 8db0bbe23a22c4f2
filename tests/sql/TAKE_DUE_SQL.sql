SELECT e.earliest, e.clock, s.id, s.name, s.agent, s.task, s.cron, s.every, s.timezone, s.priority, s.concurrency_key, s.catch_up, s.enabled, s.next_slot, s.last_slot, s.last_run_id, s.broken
  FROM (SELECT (SELECT next_slot
                  FROM agent_schedule
                 WHERE enabled AND broken = '' AND next_slot IS NOT NULL
                 ORDER BY next_slot
                 LIMIT 1) AS earliest,
               COALESCE(%(now)s::timestamptz, now()) AS clock) AS e
  LEFT JOIN LATERAL (
       SELECT *
         FROM agent_schedule
        WHERE enabled AND broken = '' AND next_slot <= e.clock
        ORDER BY next_slot
        LIMIT %(limit)s
          FOR UPDATE SKIP LOCKED) AS s ON true
 ORDER BY s.next_slot