"""The house's settings: one object read from the environment (catalog/settings.py), the only module that reads
it; elsewhere the environment is only written, or copied, to set up a child process's."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from quantgate.catalog import settings
from quantgate.warehouse import sessions
from tests.cli_runs import error_lines, quantgate

REPO = Path(__file__).resolve().parents[1]
ROOMS = ("catalog", "tasks", "warehouse", "flows")


def _is_environ(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "environ" and isinstance(node.value, ast.Name)
            and node.value.id == "os")


def _reads(tree: ast.AST) -> list[int]:
    """Lines that read a variable: os.getenv(...), os.environ.get(...), os.environ[...] as a value, ... in os.environ.
    Copying the whole environment for a child (dict(os.environ), {**os.environ}) and writes are not reads."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            f = node.func
            if (f.attr == "getenv" and isinstance(f.value, ast.Name) and f.value.id == "os") or \
                    (f.attr == "get" and _is_environ(f.value)):
                lines.append(node.lineno)
        elif isinstance(node, ast.Subscript) and _is_environ(node.value) and isinstance(node.ctx, ast.Load):
            lines.append(node.lineno)
        elif isinstance(node, ast.Compare) and any(_is_environ(c) for c in node.comparators):
            lines.append(node.lineno)
    return lines


def test_only_the_settings_module_reads_the_environment():
    found = []
    for room in ROOMS:
        for path in sorted((REPO / room).rglob("*.py")):
            if path == REPO / "catalog" / "settings.py":
                continue
            found += [f"{path.relative_to(REPO)}:{line}" for line in _reads(ast.parse(path.read_text()))]
    assert not found, "read the environment outside catalog/settings.py:\n" + "\n".join(found)


def test_the_scan_sees_each_kind_of_read():
    tree = ast.parse("import os\na = os.getenv('A')\nb = os.environ.get('B')\nc = os.environ['C']\nd = 'D' in os.environ\n"
                     "os.environ['E'] = '1'\nchild = dict(os.environ)\n")
    assert _reads(tree) == [2, 3, 4, 5]


def test_defaults_and_the_environment(monkeypatch):
    monkeypatch.delenv("QUANTGATE_HOME", raising=False)
    monkeypatch.delenv("QUANTGATE_WAREHOUSE", raising=False)
    assert settings.settings().home == Path(".quantgate") and sessions.default_path() == "quantgate.ducklake"
    monkeypatch.setenv("QUANTGATE_WAREHOUSE", "postgres:dbname=lake")
    monkeypatch.setenv("QUANTGATE_ENGINES_PER_GPU", "3")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    read = settings.settings()
    assert read.warehouse == "postgres:dbname=lake" and read.engines_per_gpu == 3
    assert read.cuda_visible_devices == ""  # set but empty (CUDA shows no GPU) is not unset
    assert settings.settings() is read  # read once


def test_a_value_it_cannot_use_is_one_line(monkeypatch, tmp_path):
    monkeypatch.setenv("QUANTGATE_LOCK_WAIT_S", "soon")
    with pytest.raises(settings.SettingsError, match=r"^QUANTGATE_LOCK_WAIT_S='soon': input should be a valid number"):
        settings.settings()
    done = quantgate("sql", "select 1", "-w", str(tmp_path / "w.ducklake"), env={"QUANTGATE_LOCK_WAIT_S": "soon"})
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert error_lines(done.stderr) == [
        "error: QUANTGATE_LOCK_WAIT_S='soon': input should be a valid number, unable to parse string as a number"]
