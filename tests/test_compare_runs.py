"""`benchmarks/compare_runs.py` over a committed H200 run of the reference model (reference12, the run whose tables
are kept) and copies of its tables: verdicts, checks and items side by side, and its exit code when a verdict differs.
The copies differ from it by real edits of their Parquet files, so each test knows what the comparison must find.
(The comparison of reference10, reference11 and reference12 themselves is `reference12/compared.md`; the other two
runs' tables are in git history, benchmarks/results/h200/README.md says where.)"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import duckdb
import pytest

REPO = Path(__file__).resolve().parents[1]
REFERENCE = REPO / "benchmarks" / "results" / "h200" / "reference12"

pytestmark = pytest.mark.skipif(not (REFERENCE / "runs.parquet").exists(),
                                reason="the committed reference12 tables are not in this checkout")

BASE = "qwen2.5-coder-1.5b-instruct@d7bc45e03b26:base"  # the base's variant_uid in reference12


def _compare(*folders: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "benchmarks/compare_runs.py", *map(str, folders)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)


def _copy(tmp_path: Path, name: str) -> Path:
    """reference12's tables (and nothing else) in tmp_path/name."""
    folder = tmp_path / name
    folder.mkdir()
    for file in REFERENCE.glob("*.parquet"):
        shutil.copyfile(file, folder / file.name)
    return folder


def _rewrite(folder: Path, table: str, select: str) -> None:
    """Replace folder/<table>.parquet by `select`, in which COMMITTED is reference12's file of that table."""
    committed = f"read_parquet('{REFERENCE / table}.parquet')"
    duckdb.sql(f"COPY ({select.replace('COMMITTED', committed)}) TO '{folder / table}.parquet' (FORMAT parquet)")


def _rows(markdown: str, section: str) -> list[list[str]]:
    part = markdown.split(f"## {section}", 1)[1].split("\n## ", 1)[0]
    return [[c.strip() for c in line.strip("|").split("|")] for line in part.splitlines()
            if line.startswith("| ") and not line.startswith("| variant") and not line.startswith("| runs")]


def test_runs_with_the_same_tables_agree_item_by_item(tmp_path):
    done = _compare(REFERENCE, _copy(tmp_path, "reference12-copy"))
    assert done.returncode == 0, done.stderr
    decisions = {r[0]: r[1:] for r in _rows(done.stdout, "Decisions")}
    assert decisions == {"awq-w4a16-g128": ["reject", "reject", "yes"],
                         "fp8-dynamic": ["inconclusive", "inconclusive", "yes"],
                         "gptq-w4a16-g128": ["inconclusive", "inconclusive", "yes"]}
    checks = _rows(done.stdout, "Checks")
    assert len(checks) == 21 and all(r[-1] == "yes" for r in checks)
    items = _rows(done.stdout, "Items")
    assert {r[1] for r in items} == {"base", "awq-w4a16-g128", "fp8-dynamic", "gptq-w4a16-g128"}
    assert all(int(r[2]) > 3000 and r[3] == r[4] == "0" for r in items), items
    # Speed is host-bound on every paired row, in both.
    speed = [r for r in _rows(done.stdout, "Speedups") if "ref-offline" == r[2]]
    assert speed and all("host-bound" in cell for r in speed for cell in r[3:])


def test_items_that_differ_are_counted_per_checkpoint_scores_and_details_apart(tmp_path):
    # In the copy, five of the base's GSM8K strict-match items score the other way, and three of its MMLU items
    # keep their score with another detail (as when an engine's batching changes a log-likelihood, not the answer).
    changed = _copy(tmp_path, "reference12-items")
    flipped = (f"variant_uid = '{BASE}' AND task = 'qg_gsm8k_cot' AND filter = 'strict-match'"
               " AND doc_id IN (0, 1, 2, 3, 4)")
    detailed = f"variant_uid = '{BASE}' AND task = 'qg_mmlu' AND doc_id IN (0, 1, 2)"
    _rewrite(changed, "quality_samples",
             f"SELECT * REPLACE (CASE WHEN {flipped} THEN 1 - value ELSE value END AS value,"
             f" CASE WHEN {detailed} THEN '{{\"edited\": true}}'::JSON ELSE detail END AS detail) FROM COMMITTED")
    assert duckdb.sql(f"SELECT count(*) FILTER ({flipped}), count(*) FILTER ({detailed})"
                      f" FROM '{changed / 'quality_samples.parquet'}'").fetchone() == (5, 3)

    done = _compare(REFERENCE, changed)
    assert done.returncode == 0, done.stderr  # the decisions are the run's, unchanged
    items = {r[1]: r[2:] for r in _rows(done.stdout, "Items")}
    assert items["base"] == ["3390", "5", "3"]
    assert all(items[v][1:] == ["0", "0"] for v in ("awq-w4a16-g128", "fp8-dynamic", "gptq-w4a16-g128")), items


def test_a_verdict_that_differs_exits_1_and_is_marked(tmp_path):
    # In the copy GPTQ is rejected (its GSM8K interval's upper bound 0.9546 read under 0.95, as one item more or less
    # of the base's 800 made it between reference9 and reference10); the other decisions stay.
    changed = _copy(tmp_path, "reference12-gptq-rejected")
    _rewrite(changed, "decisions",
             "SELECT d.* REPLACE (CASE WHEN v.name = 'gptq-w4a16-g128' THEN 'reject' ELSE d.decision END AS decision)"
             f" FROM COMMITTED d JOIN read_parquet('{REFERENCE / 'variants.parquet'}') v USING (variant_uid)")

    done = _compare(REFERENCE, changed)
    assert done.returncode == 1, done.stderr
    decisions = {r[0]: r for r in _rows(done.stdout, "Decisions")}
    assert decisions["gptq-w4a16-g128"] == ["gptq-w4a16-g128", "inconclusive", "reject", "**no**"]
    assert decisions["awq-w4a16-g128"][-1] == decisions["fp8-dynamic"][-1] == "yes"
