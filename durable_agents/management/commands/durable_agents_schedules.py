"""Install (or update) the django-q2 schedules of durable_agents' housekeeping."""

from __future__ import annotations

from typing import Any

from django.apps import apps
from django.core.management.base import BaseCommand, CommandError

from durable_agents.housekeeping.sweeps import SCHEDULES


class Command(BaseCommand):
    help = "Create or update the django-q2 schedules for the sweep, retention and metrics."

    def handle(self, *args: Any, **options: Any) -> None:
        if not apps.is_installed("django_q"):
            raise CommandError(
                "django-q2 is not installed (add 'django_q' to INSTALLED_APPS), or run "
                "`manage.py durable_agents_housekeeping` from cron instead."
            )
        from django_q.models import Schedule

        for name, func, minutes in SCHEDULES:
            _, created = Schedule.objects.update_or_create(
                name=name,
                defaults={
                    "func": func,
                    "schedule_type": Schedule.MINUTES,
                    "minutes": minutes,
                    "repeats": -1,
                },
            )
            verb = "created" if created else "updated"
            self.stdout.write(f"{verb} schedule {name!r}: {func} every {minutes} min")
