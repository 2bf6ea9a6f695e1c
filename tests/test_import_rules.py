"""The rooms' import rules that docs/architecture.md states, checked on every module's imports (module level and
inside functions alike): data flows catalog -> tasks -> warehouse -> flows, never back; inside tasks/, steps use
adapters and runtime, adapters use runtime, runtime uses neither."""

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
# tasks/ in three groups, told apart by where they live; what each may import from the others (itself always).
TASK_GROUPS = {"runtime": set(), "adapters": {"runtime"}, "steps": {"adapters", "runtime"}}


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
                broken.append(f"{path.relative_to(REPO)}:{line} imports {name}")
    assert not broken, "\n".join(broken)


def test_every_task_module_is_a_step_an_adapter_or_runtime():
    loose = [p.name for p in (REPO / "tasks").glob("*.py") if p.name != "__init__.py"]
    assert not loose, f"tasks/ modules outside steps/, adapters/ and runtime/: {loose}"
    assert {p.name for p in (REPO / "tasks").iterdir() if p.is_dir() and p.name != "__pycache__"} == set(TASK_GROUPS)


def test_task_groups_import_only_what_they_may():
    broken = []
    for group, allowed in TASK_GROUPS.items():
        for path in sorted((REPO / "tasks" / group).rglob("*.py")):
            for line, name in _imports(path):
                parts = name.split(".")
                if parts[1] != "tasks" or len(parts) < 3:
                    continue
                other = parts[2]
                if other != group and other not in allowed:
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
