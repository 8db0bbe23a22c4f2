"""Time travel: forks of a run at any step (``fork_run``), and replays of recorded runs
against today's tool code."""
