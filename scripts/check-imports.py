"""Import every module of the app and of the demo project, as the demo would meet them.

`make run` writes its install marker only when this passes, so that a dependency missing from
the install (one pyproject.toml forgot, say) fails the install step, not the demo half-way, and
the next `make run` installs again. Only the optional extras may be absent: a module that needs
one of them is allowed to fail with ModuleNotFoundError for that package alone.

    python scripts/check-imports.py          # exit 1 and a list of what failed
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The extras of pyproject.toml ([postgres], [q2], [otel], [prometheus], [test]) and what
# only the tests use: an install of the demo set has none of them.
OPTIONAL = {"psycopg", "psycopg_pool", "django_q", "opentelemetry", "prometheus_client", "pytest"}


def modules(package: str) -> list[str]:
    root = importlib.import_module(package)
    found = [package]
    for info in pkgutil.walk_packages(root.__path__, prefix=f"{package}."):
        if ".migrations." in f"{info.name}." or info.name.endswith(".migrations"):
            continue  # the migration loader imports these itself, in order
        found.append(info.name)
    return found


def main() -> int:
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
    failures: list[str] = []
    try:
        import django

        django.setup()
    except Exception:  # noqa: BLE001 - reported, not raised: the point is the list
        print("django.setup() failed:\n" + traceback.format_exc(), file=sys.stderr)
        return 1
    names = [*modules("durable_agents"), *modules("project"), "uvicorn", "dj_database_url"]
    for name in names:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as e:
            if (e.name or "").split(".")[0] not in OPTIONAL:
                failures.append(f"{name}: {e}")
        except Exception as e:  # noqa: BLE001 - every failure is listed
            failures.append(f"{name}: {type(e).__name__}: {e}")
    if failures:
        print("These modules do not import in this environment:", file=sys.stderr)
        for line in failures:
            print(f"  {line}", file=sys.stderr)
        return 1
    print(f"imports: {len(names)} modules import")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
