"""The tables the docs list are the tables the app creates."""

from __future__ import annotations

import re
from pathlib import Path

from django.apps import apps

DOCS = Path(__file__).resolve().parents[2] / "docs" / "index.md"


def test_the_docs_list_every_table_once() -> None:
    models = apps.get_app_config("durable_agents").get_models()
    created = sorted(m._meta.db_table for m in models if not m._meta.proxy)
    listed = sorted(re.findall(r"^- `(\w+)`: ", DOCS.read_text(), flags=re.MULTILINE))
    assert listed == created
    numbers = {13: "thirteen", 14: "fourteen", 15: "fifteen"}
    assert f"The {numbers[len(created)]} tables" in DOCS.read_text()
