"""Model turns through Message Batches: half the price, for runs that can wait.

A run in batches (``Agent(batch=True)``, ``start_run(..., batch=True)``) travels so:

    the run's worker    needs a model turn: records its request (``agent_batch_request``, the
                        exact body a direct call would send) and parks the run on it
                        (``waiting_for = "batch"``): no slot, no connection, no attempt held
                        (``Store.park_on_batch``, from the runner)
    submitter           every worker, every second: the requests of each ``anthropic-beta``
                        header once the oldest has waited BATCH_WINDOW_SECONDS (or
                        BATCH_MAX_REQUESTS wait) go into one batch; each request is taken by
                        one worker only (SKIP LOCKED); its ``custom_id`` is its row's id
    poller              one per batch across the fleet (a leased row): retrieves it with a
                        growing backoff; once ended, reads its results line by line and commits
                        each answer as the run's next step, the text cut from the results as
                        the API sent it, fenced on the run still waiting on that request at that
                        position; the run becomes pending
    the next claim      the run goes on with its tools as with a direct answer

Each outcome of a request: ``succeeded`` commits; ``errored`` with a request error (400)
dead-letters the run with the API's reason; ``expired``, ``canceled`` by someone else, or an
overload or server error sends it again in a later batch (at most MAX_ATTEMPTS batches), or,
once it has waited BATCH_FALLBACK_SECONDS (when set), has the run send it directly.

A worker killed between creating a batch at the API and recording its id leaves the batch row
``submitting``; once its lease has passed another worker sends its requests again. The API
answers that first batch too, but nobody reads it: those turns are paid twice. The window is
the create call alone (its answer is recorded in the statement that follows it).

    fleet.py      the submitter, the poller and the worker's thread (``BatchService``)
    results.py    one line of a batch's results: its request, and the answer's text
"""

from durable_agents.batches.fleet import BatchService, Submitter, Tally, poll_due

__all__ = ["BatchService", "Submitter", "Tally", "poll_due"]
