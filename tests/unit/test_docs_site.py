"""The documentation site says what the code holds: every page of docs/ is in mkdocs.yml's
nav, the module map of docs/contributing.md names exactly the modules and packages of
durable_agents/, and the reference pages list exactly the system checks, the management
commands and their flags, and the admin's own URLs and permissions. (The tables page is
checked by test_docs_tables.py.)"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml
from django.apps import apps
from django.contrib import admin
from django.core.management import load_command_class
from django.urls import URLPattern

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PACKAGE = ROOT / "durable_agents"


def nav_pages(entries: Any) -> Iterator[str]:
    """The page paths of a MkDocs nav, at any depth."""
    if isinstance(entries, str):
        yield entries
    elif isinstance(entries, list):
        for entry in entries:
            yield from nav_pages(entry)
    elif isinstance(entries, dict):
        for value in entries.values():
            yield from nav_pages(value)


def test_every_page_is_in_the_nav_once_and_every_nav_entry_exists() -> None:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    nav = list(nav_pages(config["nav"]))
    pages = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))
    assert sorted(nav) == pages
    assert len(nav) == len(set(nav))


def section(text: str, heading: str) -> str:
    """The text of one '## ' section of a page."""
    return text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]


def listed_modules() -> set[str]:
    """The top-level names the module map of docs/contributing.md mentions: its table's rows
    and the paragraph that starts 'Beside them' (`store/postgres.py` names `store`)."""
    where = section((DOCS / "contributing.md").read_text(), "Where things live")
    chunks = [line for line in where.splitlines() if line.startswith("| `")]
    chunks.append(where[where.index("Beside them") :].split("\n\n", 1)[0])
    names = set()
    for chunk in chunks:
        for token in re.findall(r"`([^`]+)`", chunk):
            if re.fullmatch(r"[a-z_]+(/[a-z_]+)*(\.py|/)", token):
                names.add(re.split(r"[/.]", token, maxsplit=1)[0])
    return names


def test_the_module_map_names_every_module_and_package() -> None:
    modules = {p.stem for p in PACKAGE.glob("*.py") if p.name != "__init__.py"}
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    assert sorted(listed_modules()) == sorted(modules | packages)


def test_the_checks_reference_lists_every_check_id_once() -> None:
    source = "\n".join(p.read_text() for p in PACKAGE.rglob("*.py"))
    raised = set(re.findall(r"durable_agents\.[EW]\d{3}\b", source))
    text = (DOCS / "ref" / "checks.md").read_text()
    listed = re.findall(r"^\| `(durable_agents\.[EW]\d{3})` \|", text, flags=re.MULTILINE)
    assert sorted(listed) == sorted(raised)


DJANGO_OPTIONS = {
    "-h",
    "--help",
    "--version",
    "-v",
    "--verbosity",
    "--settings",
    "--pythonpath",
    "--traceback",
    "--no-color",
    "--force-color",
    "--skip-checks",
}


def test_the_commands_reference_has_every_command_and_flag() -> None:
    text = (DOCS / "ref" / "commands.md").read_text()
    commands = sorted(p.stem for p in (PACKAGE / "management" / "commands").glob("[!_]*.py"))
    headed = sorted(re.findall(r"^## `(\w+)`", text, flags=re.MULTILINE))
    assert headed == commands
    missing = []
    for name in commands:
        parser = load_command_class("durable_agents", name).create_parser("manage.py", name)
        own = {o for a in parser._actions for o in a.option_strings} - DJANGO_OPTIONS
        part = text.split(f"\n## `{name}`", 1)[1].split("\n## ", 1)[0]
        missing += [f"{name} {o}" for o in sorted(own) if not re.search(rf"`{o}[` ]", part)]
    assert missing == []


def test_the_admin_reference_lists_its_own_urls_and_permissions() -> None:
    standard = {"", "add/", "<path:object_id>/history/", "<path:object_id>/delete/"}
    standard |= {"<path:object_id>/change/", "<path:object_id>/"}
    urls = set()
    for model, model_admin in admin.site._registry.items():
        if model._meta.app_label == "durable_agents":
            prefix = f"{model._meta.model_name}/"
            urls |= {
                prefix + str(u.pattern)
                for u in model_admin.get_urls()
                if isinstance(u, URLPattern) and str(u.pattern) not in standard
            }
    text = (DOCS / "ref" / "admin.md").read_text()
    views = section(text, "Views beyond the standard ones")
    assert sorted(re.findall(r"^\| `([^`]+)` \|", views, flags=re.MULTILINE)) == sorted(urls)
    perms = {
        f"durable_agents.{codename}"
        for model in apps.get_app_config("durable_agents").get_models()
        for codename, _ in model._meta.permissions
    }
    listed = re.findall(r"^\| `([\w.]+)` \|", section(text, "Permissions"), flags=re.MULTILINE)
    assert sorted(listed) == sorted(perms)
