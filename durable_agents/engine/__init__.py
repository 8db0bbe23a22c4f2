"""The engine: the worker that claims runs, the runner that advances one step at a time,
the dispatch of tool calls, idempotency keys, history rebuilt from the step log."""
