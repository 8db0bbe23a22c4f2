"""Cancel latency: from ``cancel_run`` to the worker abandoning the model call in flight.

A run is cancelled while its worker waits on a slow stream (``@@chunk_latency``) or a slow plain
answer (``@@latency``), at a different phase of the heartbeat each time. Uses the test settings
(the offline model behind the real SDK) on its own database::

    DATABASE_URL=postgres://root@127.0.0.1:5432/da_bench_cancel python -m bench.cancel_latency
"""

from __future__ import annotations

import os
import statistics
import threading
import time

HEARTBEAT = 1.0


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    import django

    django.setup()
    from django.core.management import call_command

    import durable_agents
    from durable_agents.models import AgentRun, AgentStep
    from durable_agents.worker import Worker

    call_command("migrate", verbosity=0)
    for agent, directive in [("streamer", "@@chunk_latency 0.2"), ("thinker", "@@latency 20")]:
        latencies = []
        for trial in range(5):
            run = durable_agents.start_run(agent, f'Slow.\n{directive}\n@lookup {{"key": "a"}}')
            worker = Worker(
                burst=True, handle_signals=False, lease_seconds=6, heartbeat_seconds=HEARTBEAT
            )
            thread = threading.Thread(target=worker.run)
            thread.start()
            while not AgentRun.objects.filter(pk=run.pk, status="running").exists():
                time.sleep(0.01)
            time.sleep(0.7 + trial * 0.13)
            cancelled = time.monotonic()
            durable_agents.cancel_run(run.pk)
            thread.join(30)
            latencies.append(time.monotonic() - cancelled)
            assert AgentStep.objects.filter(run=run).count() == 1  # nothing committed after it
        print(
            f"{agent:9} HEARTBEAT_SECONDS={HEARTBEAT}: cancel -> call abandoned: median "
            f"{statistics.median(latencies) * 1000:.0f} ms, max {max(latencies) * 1000:.0f} ms"
        )


if __name__ == "__main__":
    main()
