"""The rooms' import rules that docs/architecture.md states, checked on every module's imports (module level and
inside functions alike): data flows catalog -> tasks -> warehouse -> flows, never back."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROOMS = ("catalog", "tasks", "warehouse", "flows")
# What each room may import from the others (itself always).
MAY_IMPORT = {
    "catalog": set(),
    "tasks": {"catalog"},
    "warehouse": {"catalog"},
    "flows": {"catalog", "tasks", "warehouse"},
}
# The records and error helpers the warehouse stores and formats, which live in tasks/ today.
WAREHOUSE_MAY_USE = {"quantgate.tasks.records", "quantgate.tasks.errors", "quantgate.tasks.speed.client",
                     "quantgate.tasks.speed.metrics"}


def _imports(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
    return [(line, name) for line, name in found if name.startswith("quantgate.")]


def test_each_room_imports_only_what_it_may():
    broken = []
    for room in ROOMS:
        for path in sorted((REPO / room).rglob("*.py")):
            for line, name in _imports(path):
                other = name.split(".")[1]
                if other == room or other in MAY_IMPORT[room]:
                    continue
                if room == "warehouse" and name in WAREHOUSE_MAY_USE:
                    continue
                broken.append(f"{path.relative_to(REPO)}:{line} imports {name}")
    assert not broken, "\n".join(broken)


def test_no_module_uses_another_modules_private_names():
    broken = []
    for room in ROOMS:
        for path in sorted((REPO / room).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("quantgate."):
                    broken += [f"{path.relative_to(REPO)}:{node.lineno} imports {node.module}.{a.name}"
                               for a in node.names if a.name.startswith("_")]
    assert not broken, "\n".join(broken)
