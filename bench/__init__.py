"""Benchmarks of durable_agents. They print numbers; they are not tests. See bench/run_all.py."""
