"""Many writers, one reader, one warehouse whose catalog is in a real PostgreSQL: every key stored once.

Each writer process writes runs the way evaluate-model does (quantgate.warehouse's ledger and writers, a short session per step,
a stage's rows and its mark in one transaction); a reader queries the views the whole time and never waits."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from quantgate.catalog.records import (
    Decision, DecisionCheck, MetricResult, ModelArtifact, QualityReport, SampleResult, SpeedResult, VariantArtifact,
)
from quantgate.warehouse import ledger, reads, sessions, statements, writers
from tests.postgres import postgres_server, server_bin
from tests.warehouse_checks import duplicated_keys

pytestmark = pytest.mark.skipif(server_bin() is None, reason="PostgreSQL's server is not installed")
ROOT = Path(__file__).resolve().parents[1]


def write_runs(model_id: str, attempts: list[str]) -> None:
    """Runs of one model, each a new attempt: the content (model, builds, evaluations) is the same every time."""
    sha = f"{model_id}-sha".ljust(40, "0")
    model = ModelArtifact(model_id, f"/models/{model_id}", "local", None, sha)
    builds = [VariantArtifact(uid=f"{model_id}-{name}", model_uid=model.uid, name=name, method=method,
                              scheme=None if method == "base" else "W4A16", bits=None if method == "base" else 4,
                              group_size=128, path=f"/b/{model_id}/{name}", recipe="r", recipe_hash="h",
                              lib_versions={}, size_bytes=400 if method == "base" else 120, build_seconds=1.0,
                              peak_memory_bytes=1, status="built")
              for name, method in (("base", "base"), ("awq", "awq"), ("gptq", "gptq"))]
    for attempt in attempts:
        with sessions.session() as con:
            run_id, _ = ledger.begin_run(con, attempt, "evaluate-model", model_id, "key", None, None, "host", {})
        with sessions.session() as con, statements.transaction(con):
            writers.record_model(con, run_id, model)
            ledger.mark_stage(con, run_id, "download", "", model.uid, attempt)
        for build in builds:
            with sessions.session() as con, statements.transaction(con):
                writers.record_variant(con, run_id, build, "base" if build.method == "base" else "variant")
                ledger.mark_stage(con, run_id, "quantize", build.name, build.uid, attempt)
        for i, build in enumerate(builds):
            report = QualityReport(
                eval_key="e1", evaluator="lm-eval", config={}, seconds=1.0,
                metrics=[MetricResult("qg_piqa", "acc", "none", 0.7 - 0.01 * i, 0.02, 200, "1", True)],
                samples=[SampleResult("qg_piqa", d, "acc", float((d + i) % 3 > 0), None) for d in range(200)])
            with sessions.session() as con, statements.transaction(con):
                if not reads.has_quality(con, build.uid, "e1"):
                    writers.record_quality(con, run_id, build.uid, report)
                else:
                    writers.link_quality(con, run_id, build.uid, "e1")
                writers.record_speed(con, run_id, build.uid, [SpeedResult(
                    engine="vllm", scenario="offline", status="ok", reason=None, config={},
                    tokens_per_s=100.0 * (1 + i))])
                ledger.mark_stage(con, run_id, "evaluate", build.uid, None, attempt)
        with sessions.session() as con, statements.transaction(con):
            check = DecisionCheck("quality", "qg_piqa/acc", "pass", "ok", task="qg_piqa", metric="acc", value=0.99)
            writers.record_decisions(con, run_id, [Decision(b.uid, "accept", "accept: ok", [check], "ph", 0.99, 2.0, 0.3)
                                                   for b in builds[1:]], {"version": 1})
            ledger.mark_stage(con, run_id, "decide", "", None, attempt)
        with sessions.session() as con:
            ledger.finish_run(con, run_id, attempt_id=attempt)


def _writer(model_id: str, attempts: list[str], env: dict[str, str]) -> subprocess.Popen:
    code = f"from tests.test_lake_concurrency import write_runs; write_runs({model_id!r}, {attempts!r})"
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def postgres():
    with postgres_server() as conninfo:
        yield conninfo


@pytest.fixture(scope="module")
def lake_data(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("lake")) + "/"


def test_four_writers_and_a_reader_on_a_postgresql_catalog_store_every_key_once(postgres, lake_data, monkeypatch):
    warehouse = f"postgres:{postgres}"
    env = {**os.environ, sessions.ENV_VAR: warehouse, sessions.DATA_ENV_VAR: lake_data}
    monkeypatch.setenv(sessions.ENV_VAR, warehouse)
    monkeypatch.setenv(sessions.DATA_ENV_VAR, env[sessions.DATA_ENV_VAR])
    with sessions.session() as con:  # created and migrated once, before the writers race
        pass
    writers = [_writer(f"model-{k}", [f"a{k}-{n}" for n in range(3)], env) for k in range(4)]
    # The same model twice at once: its content is stored once, each attempt's run rows are its own.
    writers += [_writer("model-twice", [f"twice-{k}"], env) for k in range(2)]
    times_read, seen = 0, set()
    while any(w.poll() is None for w in writers):
        with sessions.session(read_only=True) as con:
            for row in reads.rows(con, "SELECT run_id, decision FROM variant_scorecard"):
                seen.add(row["run_id"])
            times_read += 1
    errors = [w.stderr.read() for w in writers if w.returncode != 0]
    assert errors == []
    with sessions.session(read_only=True) as con:
        assert duplicated_keys(con) == {}
        runs = reads.rows(con, "SELECT model_id, status, count(*) AS n FROM runs GROUP BY ALL ORDER BY model_id")
        assert runs == [{"model_id": f"model-{k}", "status": "completed", "n": 3} for k in range(4)] + [
            {"model_id": "model-twice", "status": "completed", "n": 2}]
        assert con.execute("SELECT count(*) FROM variants").fetchone() == (15,)
        assert con.execute("SELECT count(*) FROM quality_samples").fetchone() == (15 * 200,)
        assert con.execute("SELECT count(*) FROM decisions").fetchone() == (14 * 2,)
        latest = reads.rows(con, "SELECT model_id, count(*) AS n FROM variant_scorecard GROUP BY ALL ORDER BY 1")
        assert [r["n"] for r in latest] == [2] * 5
    assert times_read > 5 and seen  # the reader read throughout, and saw runs as they were written


def test_a_reader_sees_the_last_commit_while_a_write_is_open(postgres, lake_data, monkeypatch):
    monkeypatch.setenv(sessions.ENV_VAR, f"postgres:{postgres}")
    monkeypatch.setenv(sessions.DATA_ENV_VAR, lake_data)
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys\nfrom quantgate.warehouse import ledger, sessions, statements\n"
        "with sessions.session() as con, statements.transaction(con):\n"
        "    ledger.start_run(con, 'open-run', 'f', 'm', None, None, 'h', {})\n"
        "    print('open', flush=True)\n"
        "    sys.stdin.readline()\n")], cwd=ROOT, env=dict(os.environ), stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "open"
        started = time.monotonic()
        with sessions.session(read_only=True) as con:
            assert con.execute("SELECT count(*) FROM runs WHERE run_id = 'open-run'").fetchone() == (0,)
        assert time.monotonic() - started < 5
        holder.stdin.write("commit\n")
        holder.stdin.flush()
        assert holder.wait(timeout=60) == 0
    finally:
        holder.kill()
    with sessions.session(read_only=True) as con:
        assert con.execute("SELECT count(*) FROM runs WHERE run_id = 'open-run'").fetchone() == (1,)
