"""The tables the docs list are the tables the app creates."""

from __future__ import annotations

import re
from pathlib import Path

from django.apps import apps

DOCS = Path(__file__).resolve().parents[2] / "docs" / "ref" / "tables.md"


def test_the_docs_list_every_table_once() -> None:
    models = apps.get_app_config("durable_agents").get_models()
    created = sorted(m._meta.db_table for m in models if not m._meta.proxy)
    listed = sorted(re.findall(r"^- `(\w+)`: ", DOCS.read_text(), flags=re.MULTILINE))
    assert listed == created
    numbers = {19: "nineteen", 20: "twenty", 21: "twenty-one"}
    assert f"The {numbers[len(created)]} tables" in DOCS.read_text()


ROOT = DOCS.parents[2]


def test_the_settings_reference_lists_every_setting_once() -> None:
    """docs/ref/settings.md is the one list of the settings (the README links to it)."""
    from durable_agents.conf import DEFAULTS

    text = (ROOT / "docs" / "ref" / "settings.md").read_text()
    listed = re.findall(r"^\| `([A-Z][A-Z0-9_]+)` \|", text, flags=re.MULTILINE)
    assert sorted(listed) == sorted(DEFAULTS)


def test_the_readme_keeps_no_second_copy_of_the_settings() -> None:
    readme = (ROOT / "README.md").read_text()
    from durable_agents.conf import DEFAULTS

    rows = [key for key in DEFAULTS if re.search(rf"^\| `{key}` \|", readme, flags=re.MULTILINE)]
    assert rows == [], "settings are listed in docs/ref/settings.md only"
    assert "(docs/ref/settings.md)" in readme


def test_the_quickstart_names_every_runtime_dependency() -> None:
    """What the quickstart says pip installs with the app is what pyproject.toml declares."""
    import tomllib

    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {re.split(r"[<>=!~\[; ]", d, maxsplit=1)[0].lower() for d in declared}
    quickstart = (ROOT / "docs" / "intro" / "quickstart.md").read_text()
    [sentence] = re.findall(r"The runtime dependencies are ([^.]+)\.", quickstart)
    named = {re.sub(r"[`\s]", "", n).lower() for n in re.split(r",|\band\b", sentence)}
    named = {n.split("(")[0] for n in named if n}
    assert named == names
