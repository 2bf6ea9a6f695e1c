"""evaluate-model's stage names are one enum (catalog/stages.Stage): the flows name a stage only through it, and the
names the warehouse's SQL compares `run_stages.stage` with are its values (the strings stored)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from quantgate.catalog.stages import UNMEASURED, Stage

REPO = Path(__file__).resolve().parents[1]
STAGE_CALLS = {"step", "stage", "enter", "is_done"}  # flows/stage_run.StageRun's methods that take a stage


def test_stage_values_are_the_names_stored():
    assert [s.value for s in Stage] == ["download", "quantize", "evaluate", "kl", "benchmark", "probe", "decide"]
    assert all(s == s.value and f"{s}" == s.value and hash(s) == hash(s.value) for s in Stage)


def test_flows_name_stages_through_the_enum():
    bare = []
    for path in sorted((REPO / "flows").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in STAGE_CALLS
                    and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
                bare.append(f"{path.relative_to(REPO)}:{node.lineno} {node.func.attr}({node.args[0].value!r})")
    assert not bare, "\n".join(bare)


def test_sql_names_only_stages_there_are():
    named: dict[str, set[str]] = {}
    for path in sorted((REPO / "warehouse").rglob("*.sql")):
        sql = path.read_text()
        for match in re.finditer(r"stage\s*(?:=\s*'([^']*)'|IN\s*\(([^)]*)\))", sql, re.IGNORECASE):
            names = {match[1]} if match[1] else {n.strip().strip("'") for n in match[2].split(",")}
            named.setdefault(path.name, set()).update(names)
    assert all(names <= set(Stage) for names in named.values()), named
    # The measurement windows' unmeasured work is the enum's.
    assert named["92_measurement_windows.sql"] == set(UNMEASURED)
