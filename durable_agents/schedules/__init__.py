"""Agents on a clock: declaring schedules (``schedule``, ``defining``) and firing their due
slots (``firing``, a service every worker runs)."""
