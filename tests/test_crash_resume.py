"""Crash safety: SIGKILL the `quantgate run` process in each stage, rerun, and prove nothing was lost,
nothing duplicated, nothing already stored done again, and every variant decided.

Real subprocesses, real SIGKILL (QUANTGATE_FAULT makes the process kill itself at a named point, which
is deterministic where a timed kill is not), real Prefect server, DuckDB, llm-compressor, lm-eval and
transformers on the tiny model. A small catalog keeps each step to seconds: two data-free variants (one
that builds, one whose group size does not divide the layers), three perplexity documents, one tiny
benchmark scenario. The kills are chained: each rerun resumes the previous crash and dies in the next stage.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from quantgate.warehouse import reads, sessions
from tests.cli_runs import run_cli, run_log, tables, tiny_catalog
from tests.shared_data import TINY_MODEL

pytestmark = pytest.mark.slow

# Tables whose rows are results: a row stored once must survive every later crash and rerun unchanged.
RESULTS = ("models", "variants", "run_variants", "quality_evals", "quality_results", "quality_samples",
           "speed_results", "decisions", "run_stages")


def catalog(tmp: Path, model: Path) -> Path:
    return tiny_catalog(tmp, model, {"rtn-w8a16": "{method: rtn, scheme: W8A16, group_size: null}",
                                     # stories260k's layers are 64 wide: this build fails, by design
                                     "rtn-w4a16-g128": "{method: rtn, scheme: W4A16, group_size: 128}"})


@pytest.fixture(scope="module")
def setup(tmp_path_factory, prefect_api):
    if not TINY_MODEL.exists():
        pytest.skip(f"shared tiny model not found at {TINY_MODEL}")
    tmp = tmp_path_factory.mktemp("crash")
    cat = catalog(tmp, TINY_MODEL)
    wh, work = tmp / "w.ducklake", tmp / "work"

    def run(fault: str | None, *options: str):
        env = {"QUANTGATE_FAULT": fault} if fault else {"QUANTGATE_FAULT": ""}
        return run_cli(["run", "tiny", "-c", str(cat), "-w", str(wh), "--workdir", str(work), *options], prefect_api,
                       env)

    return wh, work, run


def _kept(before: dict, after: dict) -> None:
    """Every result row stored before is still there, unchanged (timestamps included: not redone)."""
    for table in RESULTS:
        # run_variants.eval_key is filled in by the variant's evaluation stage, later than its row.
        view = (lambda r: r[:4]) if table == "run_variants" else (lambda r: r)  # noqa: E731
        missing = {view(r) for r in before.get(table, [])} - {view(r) for r in after[table]}
        assert not missing, f"{table}: rows lost or rewritten by the rerun: {sorted(missing)[:3]}"


def _stages(contents: dict) -> set[tuple[str, str]]:
    return {(row[1], row[2]) for row in contents["run_stages"]}


def test_killed_in_every_stage_then_resumed_loses_and_duplicates_nothing(setup):
    wh, work, run = setup
    history = []

    def crash(fault: str) -> dict:
        result = run(fault)
        assert result.returncode == -9, result.stderr[-3000:]
        assert f"SIGKILL at {fault if '@' in fault else fault + '@1'}" in run_log(result)
        contents = tables(wh)
        if history:
            _kept(history[-1], contents)
        history.append(contents)
        return contents

    # 1. Download: nothing stored yet but the unfinished run.
    after = crash("download")
    assert [r[5] for r in after["runs"]] == ["running"] and not after["models"] and not _stages(after)

    # 2. Quantize: the base's evaluation (first) is committed; the first build is written to its temporary folder
    # and killed before the rename.
    after = crash("quantize")
    assert {s for s, _ in _stages(after)} == {"download", "evaluate"} and len(after["quality_evals"]) == 1
    variants = work / "variants"
    orphans = [p.name for p in variants.iterdir() if p.name.endswith(".tmp")]
    assert len(orphans) == 1 and not [p for p in variants.iterdir() if not p.name.startswith(".")]

    # 3. Evaluate: the base's evaluation is stored, so the first one this rerun computes is the variant's, right
    # after its build: computed and lost.
    after = crash("evaluate")
    assert [p.name for p in variants.iterdir() if p.name.endswith(".tmp")] == []  # the orphan was swept
    built = {r[2]: r[14] for r in after["variants"]}  # name -> status: the second variant's build comes after
    assert built == {"base": "built", "rtn-w8a16": "built"}
    assert {s for s, _ in _stages(after)} == {"download", "quantize", "evaluate"}
    assert len(after["quality_evals"]) == 1

    # 4. Benchmark: the base's speed is committed, the variant's is measured and lost.
    after = crash("benchmark@2")
    assert len(after["quality_evals"]) == 3  # base + variant suite, variant KL
    assert len(after["speed_results"]) == 1

    # 5. Warehouse write: killed inside the decisions' transaction, after its rows were inserted.
    after = crash("write:decide")
    assert len(after["speed_results"]) == 2
    assert not after["decisions"] and ("decide", "") not in _stages(after)

    # 6. The rerun that finishes.
    result = run(None)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resuming run" in run_log(result)
    final = tables(wh)
    _kept(history[-1], final)
    _kept(history[0], final)

    with sessions.session(wh, read_only=True) as con:
        runs = reads.rows(con, "SELECT run_id, status FROM runs")
        assert len(runs) == 1 and runs[0]["status"] == "completed"  # every attempt worked on one run
        run_id = runs[0]["run_id"]
        attempts = reads.rows(con, "SELECT status FROM run_attempts ORDER BY started_at")
        assert [a["status"] for a in attempts] == ["abandoned"] * 5 + ["completed"]
        for table in RESULTS + ("runs", "run_attempts"):
            (n, distinct) = con.execute(f"SELECT count(*), count(DISTINCT t) FROM {table} t").fetchone()
            assert n == distinct, f"{table} has duplicate rows"
        # Exactly one result per thing measured: no row of a killed attempt stored beside its redo.
        assert con.execute("SELECT count(*) FROM speed_results").fetchone()[0] == 2
        assert con.execute("SELECT count(*) FROM quality_evals").fetchone()[0] == 3
        decided = reads.rows(con, "SELECT v.name, d.decision, d.reason FROM run_variants rv"
                                  " JOIN variants v USING (variant_uid)"
                                  " LEFT JOIN decisions d ON d.run_id = rv.run_id AND d.variant_uid = rv.variant_uid"
                                  " WHERE rv.run_id = ? AND rv.role = 'variant' ORDER BY v.name", [run_id])
    assert [(d["name"], d["decision"]) for d in decided] == [("rtn-w4a16-g128", "reject"), ("rtn-w8a16", "accept")]
    # A variant's failure (one line, its reason) never stopped the other.
    assert decided[0]["reason"].startswith(
        "reject: build failed: rtn-w4a16-g128: group size 128 does not divide in_features 64 of")
    assert _stages(final) == {
        ("download", ""), ("quantize", "rtn-w8a16"), ("quantize", "rtn-w4a16-g128"), ("decide", ""),
        *{(s, uid) for s in ("evaluate", "benchmark") for uid in (base_uid(final), variant_uid(final))},
        ("kl", variant_uid(final)),
    }
    # No half-written checkpoint anywhere: one finished folder, with its completion marker.
    folders = sorted(p.name for p in (work / "variants").iterdir())
    assert folders == [variant_uid(final)] and (work / "variants" / folders[0] / ".quantgate-variant.json").is_file()


def test_a_fresh_run_after_a_finished_one_reuses_speed_unless_remeasured(setup):
    """Only unfinished runs are resumed: the run after a successful one is a new run. With nothing changed
    it reuses what is stored, speed rows included, and says so; --remeasure measures speed again."""
    wh, _, run = setup
    before = tables(wh)
    result = run(None)
    assert result.returncode == 0, result.stderr[-3000:]
    output = run_log(result)
    assert "resuming run" not in output and output.count("speed unchanged since run") == 2  # base and the variant
    after = tables(wh)
    _kept(before, after)
    with sessions.session(wh, read_only=True) as con:
        assert con.execute("SELECT count(*) FROM runs WHERE status = 'completed'").fetchone()[0] == 2
        assert con.execute("SELECT count(DISTINCT run_id), count(*) FROM speed_results").fetchone() == (1, 2)
        assert con.execute("SELECT count(*) FROM quality_evals").fetchone()[0] == 3
        latest = con.execute("SELECT run_id FROM runs ORDER BY started_at DESC LIMIT 1").fetchone()[0]
        # The new run's views see the reused rows under its own id: its decision has its speedup.
        assert con.execute("SELECT count(*) FROM variant_speedup WHERE run_id = ? AND speedup IS NOT NULL",
                           [latest]).fetchone()[0] == 1
        assert con.execute("SELECT sum(engine_starts) FROM stage_times WHERE run_id = ? AND stage = 'benchmark'",
                           [latest]).fetchone()[0] == 0

    result = run(None, "--remeasure")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "speed unchanged" not in result.stderr + result.stdout
    with sessions.session(wh, read_only=True) as con:
        assert con.execute("SELECT count(DISTINCT run_id), count(*) FROM speed_results").fetchone() == (2, 4)
        latest = con.execute("SELECT run_id FROM runs ORDER BY started_at DESC LIMIT 1").fetchone()[0]
        assert con.execute("SELECT sum(engine_starts) FROM stage_times WHERE run_id = ? AND stage = 'benchmark'",
                           [latest]).fetchone()[0] == 3  # a Transformers session per checkpoint; the variant's loads the base too


def base_uid(contents: dict) -> str:
    return next(r[0] for r in contents["variants"] if r[3] == "base")


def variant_uid(contents: dict) -> str:
    return next(r[0] for r in contents["variants"] if r[2] == "rtn-w8a16")

