
WITH RECURSIVE pairs AS (
    (SELECT agent, prompt_version
       FROM agent_run
      WHERE status IN ('pending', 'running', 'waiting')
      ORDER BY agent, prompt_version
      LIMIT 1)
    UNION ALL
    SELECT next.agent, next.prompt_version
      FROM pairs,
           LATERAL (SELECT agent, prompt_version
                      FROM agent_run
                     WHERE status IN ('pending', 'running', 'waiting')
                       AND (agent, prompt_version) > (pairs.agent, pairs.prompt_version)
                     ORDER BY agent, prompt_version
                     LIMIT 1) AS next
)
SELECT agent, prompt_version FROM pairs