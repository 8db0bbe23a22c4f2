"""The fleet's reads on PostgreSQL: the agent versions that runs in flight are pinned to.

versions   IN_FLIGHT_VERSIONS_SQL   the distinct (agent, prompt_version) of the pending,
                                    running and waiting runs, by a loose index scan of
                                    agent_run_in_flight_version: one index probe per
                                    version, however many runs each has (a plain DISTINCT
                                    reads every run in flight)
"""

from __future__ import annotations

from django.db import connection

IN_FLIGHT = "status IN ('pending', 'running', 'waiting')"

IN_FLIGHT_VERSIONS_SQL = f"""
WITH RECURSIVE pairs AS (
    (SELECT agent, prompt_version
       FROM agent_run
      WHERE {IN_FLIGHT}
      ORDER BY agent, prompt_version
      LIMIT 1)
    UNION ALL
    SELECT next.agent, next.prompt_version
      FROM pairs,
           LATERAL (SELECT agent, prompt_version
                      FROM agent_run
                     WHERE {IN_FLIGHT}
                       AND (agent, prompt_version) > (pairs.agent, pairs.prompt_version)
                     ORDER BY agent, prompt_version
                     LIMIT 1) AS next
)
SELECT agent, prompt_version FROM pairs"""


def in_flight_versions() -> list[tuple[str, str]]:
    """IN_FLIGHT_VERSIONS_SQL: (agent, version) of every run in flight, each once."""
    with connection.cursor() as cursor:
        cursor.execute(IN_FLIGHT_VERSIONS_SQL)
        return [(agent, version) for agent, version in cursor.fetchall()]
