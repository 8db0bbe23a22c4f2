"""The operations of the admin from a shell: ``manage.py durable_agents <subcommand>``.

The management command (``management/commands/durable_agents.py``) only parses its arguments;
the work is here, one module per job:

    lookup       what an operator types, checked before anything is done: run ids (whole, or
                 short as the admin shows them), intent ids, users, statuses, times, metadata
    listing      what is read: runs, one run with its transcript, intents, workers
    decisions    what changes state: cancel, requeue, approve, reject (through the api, and
                 audited as the admin's decisions are: ``durable_agents.audit``)
    formatting   text for a terminal (columns, times in ISO 8601 UTC, and text from outside
                 with its control characters escaped) and the JSON document of ``--json``

Each subcommand returns an ``Output``: the JSON document, the text lines, and what failed (the
command then exits with status 1 after printing the rest).
"""
