"""Flow control: capacity (the fleet's share of the provider's rate limits, learned from
its headers), concurrency keys, budgets and prices."""
