"""What an application declares: agents (``Agent``), tools (``@tool`` and their effect
classes), waits (``Wait``, ``ask_person``). Touches no database."""
