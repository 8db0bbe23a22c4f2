"""No class of durable_agents has more than two bases of the package's own: behaviour is shared
by composition (an object the class holds, as the runs admin holds its pages), not by stacking
mixins. Read from the source (no import): a base is the package's own when its name is a class
of the same module, or comes from an import of ``durable_agents``."""

from __future__ import annotations

import ast
from pathlib import Path

import durable_agents

PACKAGE = Path(durable_agents.__file__).parent
MAX_OWN_BASES = 2


def _root_name(node: ast.expr) -> str | None:
    """``Name`` of ``Name[...]`` or ``Name.attr``: what a base is reached through."""
    while isinstance(node, ast.Subscript | ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _own_names(tree: ast.Module) -> set[str]:
    """Names that stand for the package in a module: its classes, and what it imports from
    ``durable_agents`` (a class, or a module whose attributes are)."""
    names = {node.name for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (
            node.level > 0 or (node.module or "").split(".")[0] == "durable_agents"
        ):
            names.update(alias.asname or alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "durable_agents":
                    names.add(alias.asname or alias.name.split(".")[0])
    return names


def own_bases() -> dict[str, list[str]]:
    """Every class of the package (migrations aside), as ``path:line Name``, with its bases
    of the package's own."""
    found: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if "migrations" in path.relative_to(PACKAGE).parts:
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        own = _own_names(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                where = f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name}"
                found[where] = [ast.unparse(b) for b in node.bases if _root_name(b) in own]
    return found


def test_no_class_has_more_than_two_bases_of_our_own() -> None:
    classes = own_bases()
    runs_admin = next(bases for where, bases in classes.items() if where.endswith(" AgentRunAdmin"))
    assert runs_admin  # the scan sees the package's own bases
    crowded = {where: bases for where, bases in classes.items() if len(bases) > MAX_OWN_BASES}
    assert not crowded, f"classes with more than {MAX_OWN_BASES} bases of our own: {crowded}"
