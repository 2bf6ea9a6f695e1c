"""`benchmarks/compare_runs.py` over committed H200 runs of the reference model: verdicts, checks and items side by
side, and its exit code when a verdict differs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = "benchmarks/results/h200"


def _compare(*runs: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "benchmarks/compare_runs.py", *(f"{RESULTS}/{r}" for r in runs)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)


def _rows(markdown: str, section: str) -> list[list[str]]:
    part = markdown.split(f"## {section}", 1)[1].split("\n## ", 1)[0]
    return [[c.strip() for c in line.strip("|").split("|")] for line in part.splitlines()
            if line.startswith("| ") and not line.startswith("| variant") and not line.startswith("| runs")]


def test_two_machines_with_repeatable_evaluations_agree_item_by_item():
    done = _compare("reference11", "reference12")
    assert done.returncode == 0, done.stderr
    decisions = {r[0]: r[1:] for r in _rows(done.stdout, "Decisions")}
    assert decisions == {"awq-w4a16-g128": ["reject", "reject", "yes"],
                         "fp8-dynamic": ["inconclusive", "inconclusive", "yes"],
                         "gptq-w4a16-g128": ["inconclusive", "inconclusive", "yes"]}
    assert all(r[-1] == "yes" for r in _rows(done.stdout, "Checks"))
    items = _rows(done.stdout, "Items")
    assert {r[1] for r in items} == {"base", "awq-w4a16-g128", "fp8-dynamic", "gptq-w4a16-g128"}
    assert all(int(r[2]) > 3000 and r[3] == r[4] == "0" for r in items), items
    # Speed is host-bound on every paired row, in both runs.
    speed = [r for r in _rows(done.stdout, "Speedups") if "ref-offline" == r[2]]
    assert speed and all("host-bound" in cell for r in speed for cell in r[3:])


def test_items_differ_where_the_engine_core_ran_in_its_own_process():
    done = _compare("reference10", "reference11")
    assert done.returncode == 0, done.stderr
    base = next(r for r in _rows(done.stdout, "Items") if r[1] == "base")
    assert int(base[3]) > 0


def test_a_verdict_that_differs_exits_1_and_is_marked():
    done = _compare("reference9", "reference10")
    assert done.returncode == 1
    gptq = next(r for r in _rows(done.stdout, "Decisions") if r[0] == "gptq-w4a16-g128")
    assert gptq == ["gptq-w4a16-g128", "reject", "inconclusive", "**no**"]
