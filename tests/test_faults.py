"""Fault handling below the flow: vLLM's out-of-memory ladder, NaN/Inf outputs failing a variant, and which
unfinished run a rerun resumes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from dataclasses import replace

import pytest
import torch

from quantgate.catalog.scenarios import OfflineScenario
from quantgate.tasks.adapters import engines
from quantgate.tasks.adapters.engines import EngineOptions
from quantgate.tasks.adapters.engines.transformers import TransformersEngine
from quantgate.tasks.adapters.speed.retry import Failure, fallback_options, retry_on_oom
from quantgate.tasks.runtime import launch
from quantgate.tasks.steps.benchmark import run_scenarios
from quantgate.warehouse import ledger, reads, sessions, statements, transfer, writers


class OutOfMemoryUntilSmall(TransformersEngine):
    """Stands in for vLLM on a CPU machine: its start fails the way vLLM 0.26's does on a GPU that is too
    small (torch's OutOfMemoryError with the CUDA allocator's text; then vLLM's KV-cache ValueError) until
    gpu_memory_utilization <= 0.6 and max_model_len fits the scenario; then it is Transformers on the CPU."""

    name = "vllm"
    starts: list[tuple[float, int | None]] = []

    def load(self, model_path, options):
        OutOfMemoryUntilSmall.starts.append((options.gpu_memory_utilization, options.max_model_len))
        if options.gpu_memory_utilization > 0.6:
            raise torch.OutOfMemoryError(
                "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 139.81 GiB of which"
                " 1.02 GiB is free.")
        if options.max_model_len and options.max_model_len > 64:
            raise ValueError(
                f"To serve at least one request with the models's max seq len ({options.max_model_len}), (2.25 GiB KV"
                " cache is needed, which is larger than the available KV cache memory (1.05 GiB).")
        super().load(model_path, replace(options, max_model_len=None))


def test_vllm_out_of_memory_is_retried_with_less_memory_then_a_shorter_context(tiny_model, tmp_path, monkeypatch):
    """What this covers: the ladder's logic in run_scenarios (which options are tried in which order, what
    counts as out of memory, what is recorded) with an engine that raises the real error types and messages.
    What it does not: vLLM itself on a GPU (no CUDA here) and the spawned-process path (isolate=True), whose
    child would not see this test's engine registration; both share the same loop."""
    monkeypatch.setitem(engines.ENGINES, "vllm", replace(engines.ENGINES["vllm"], path=f"{__name__}:OutOfMemoryUntilSmall"))
    monkeypatch.setattr(engines, "availability", lambda engine, device: None)
    OutOfMemoryUntilSmall.starts = []
    scenario = OfflineScenario(engines=["transformers", "vllm"], device="cpu", num_prompts=2, input_len=8,
                            output_len=4, batch_size=2, repetitions=1, warmup=0, max_model_len=4096,
                            gpu_memory_utilization=0.8)
    [result] = run_scenarios(str(tiny_model), "vllm", [("tiny", scenario)], isolate=False)

    assert OutOfMemoryUntilSmall.starts == [(0.8, 4096), (0.6, 4096), (0.6, 12)]
    assert result.status == "ok" and result.output_tokens == 2 * 4
    attempts = result.details["attempts"]
    assert [(a["gpu_memory_utilization"], a["max_model_len"]) for a in attempts] == [(0.8, 4096), (0.6, 4096)]
    assert attempts[0]["error"].startswith("OutOfMemoryError: CUDA out of memory")
    # What was finally used is stored with the result.
    with sessions.session(tmp_path / "w.ducklake") as con:
        writers.record_speed(con, "r1", "v1", [result])
        config, details = con.execute("SELECT config, details FROM speed_results").fetchone()
    used = json.loads(config)["engine_options"]
    assert (used["gpu_memory_utilization"], used["max_model_len"]) == (0.6, 12)
    assert len(json.loads(details)["attempts"]) == 2


def test_a_failure_that_is_not_out_of_memory_is_not_retried(tiny_model, monkeypatch):
    class Broken(TransformersEngine):
        def load(self, model_path, options):
            raise ValueError("unknown quantization method 'foo'")

    monkeypatch.setattr(sys.modules[__name__], "Broken", Broken, raising=False)
    monkeypatch.setitem(engines.ENGINES, "vllm", replace(engines.ENGINES["vllm"], path=f"{__name__}:Broken"))
    monkeypatch.setattr(engines, "availability", lambda engine, device: None)
    scenario = OfflineScenario(engines=["transformers", "vllm"], device="cpu", num_prompts=2, input_len=8,
                            output_len=4, batch_size=2, repetitions=1, warmup=0, max_model_len=4096)
    [result] = run_scenarios(str(tiny_model), "vllm", [("tiny", scenario)], isolate=False)
    assert result.status == "failed" and result.reason == "ValueError: unknown quantization method 'foo'"
    assert "attempts" not in result.details



NO_LIMIT = launch.Deadline(float("inf"))


def test_the_one_oom_retry_reads_the_cause_from_the_log_and_counts_every_start(tmp_path):
    """The retry the offline engines, `vllm serve` and `vllm bench` share: an out-of-memory line found only in
    the log counts, the log's first exception line is the reason's cause, and a ladder that runs out of options
    has made exactly as many starts as it has options."""
    log = tmp_path / "serve.log"
    log.write_text("INFO starting\n(EngineCore_DP0 pid=7) ValueError: No available memory for the cache blocks.\n")
    ladder = fallback_options(EngineOptions("cuda", "bfloat16", max_model_len=4096), "vllm", 96)
    tried = retry_on_oom(ladder, NO_LIMIT, lambda used, n: Failure("Engine core initialization failed", log))
    assert [(o.gpu_memory_utilization, o.max_model_len) for o in ladder] == [(0.8, 4096), (0.6, 4096), (0.6, 96)]
    assert tried.value is None and tried.exhausted and tried.engine_starts == len(tried.attempts) == 3
    assert tried.error == ("Engine core initialization failed"
                           " (cause: ValueError: No available memory for the cache blocks.)")
    seen = []

    def third_time_lucky(used, n):
        seen.append(n)
        return "measured" if n == 2 else Failure("torch.OutOfMemoryError: CUDA out of memory")

    ok = retry_on_oom(ladder, NO_LIMIT, third_time_lucky)
    assert (ok.value, ok.used, ok.engine_starts, seen) == ("measured", ladder[2], 3, [0, 1, 2])
    other = retry_on_oom(ladder, NO_LIMIT, lambda used, n: Failure("ValueError: unknown quantization method"))
    late = retry_on_oom(ladder, launch.Deadline(0), lambda used, n: Failure("CUDA out of memory"))
    assert (other.error, other.attempts, other.engine_starts) == ("ValueError: unknown quantization method", [], 1)
    assert (late.used, late.attempts, late.engine_starts) == (ladder[0], [], 1)
    # Memory freed by another process while vLLM profiled says nothing of the engine's size: once more as it was.
    raced = []

    def raced_once(used, n):
        raced.append(used)
        return "measured" if n == 1 else Failure("AssertionError: Error in memory profiling. Initial free memory 137.85"
                                                 " GiB, current free memory 138.38 GiB.")

    again = retry_on_oom(ladder, NO_LIMIT, raced_once)
    assert (again.value, raced, again.engine_starts) == ("measured", [ladder[0], ladder[0]], 2)
    always = retry_on_oom(ladder, NO_LIMIT, lambda used, n: Failure("AssertionError: Error in memory profiling."))
    assert [a["gpu_memory_utilization"] for a in always.attempts] == [0.8, 0.8, 0.6, 0.6] and always.exhausted

def test_a_paused_point_says_where_it_is_and_goes_on_when_told(tmp_path):
    """QUANTGATE_FAULT=<point>=pause in a real process: it writes the point, its pid and where it is, waits, and goes
    on once its go file exists (a GPU fault test kills an engine core meanwhile, then lets its engine measure)."""
    paused = tmp_path / "paused"
    code = "from quantgate.tasks.runtime import faults; faults.point('measure:loaded', '/w/variants/v1'); print('on')"
    env = {**os.environ, "QUANTGATE_FAULT": "measure:loaded=pause", "QUANTGATE_FAULT_PAUSED": str(paused)}
    child = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (paused.exists() and paused.read_text().endswith("\n")):
            assert child.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        assert paused.read_text() == f"measure:loaded@1 {child.pid} /w/variants/v1\n"
        time.sleep(0.3)
        assert child.poll() is None  # still held
        (tmp_path / f"paused.{child.pid}.go").touch()
        assert child.communicate(timeout=30)[0] == "on\n" and child.returncode == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


# --- which run a rerun resumes -------------------------------------------------------------------


def _begin(con, attempt, key="k"):
    return ledger.begin_run(con, attempt, "evaluate-model", "m", key, "c.yaml", "h", "this-host", {})


def test_a_rerun_resumes_only_an_unfinished_run_of_the_same_request(tmp_path, monkeypatch):
    monkeypatch.setattr("platform.node", lambda: "this-host")
    with sessions.session(tmp_path / "w.ducklake") as con:
        assert _begin(con, "a1") == ("a1", False)
        ledger.finish_run(con, "a1", attempt_id="a1")
        assert _begin(con, "a2") == ("a2", False)  # after a finished run: a new run
        # a2's process is this one, so it may still be at work: a concurrent rerun does not take it over.
        con.execute("UPDATE run_attempts SET pid = ? WHERE attempt_id = 'a2'", [os.getppid()])
        assert _begin(con, "a3") == ("a3", False)
        # a3 dies (its pid is gone): the next rerun of the same request resumes it, and says a3 was abandoned.
        dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
        con.execute("UPDATE run_attempts SET pid = ? WHERE attempt_id = 'a3'", [int(dead.stdout)])
        assert _begin(con, "a4") == ("a3", True)
        assert reads.rows(con, "SELECT attempt_id, run_id, status FROM run_attempts WHERE run_id = 'a3' ORDER BY 1") == [
            {"attempt_id": "a3", "run_id": "a3", "status": "abandoned"},
            {"attempt_id": "a4", "run_id": "a3", "status": "running"}]
        # A Prefect retry of the same flow run continues its run.
        assert _begin(con, "a4") == ("a3", False)
        # a4 fails; a rerun asking for something else (another key) starts afresh and leaves a3 failed.
        ledger.finish_run(con, "a3", error="boom", attempt_id="a4")
        assert _begin(con, "a5", key="other") == ("a5", False)
        assert con.execute("SELECT status, error FROM runs WHERE run_id = 'a3'").fetchone() == ("failed", "boom")


def test_stage_rows_and_their_mark_commit_together(tmp_path):
    from tests.test_warehouse import _speed

    with sessions.session(tmp_path / "w.ducklake") as con:
        with pytest.raises(RuntimeError), statements.transaction(con):
            writers.record_speed(con, "r", "v", [_speed(1.0)])  # its own transaction joins the outer one
            ledger.mark_stage(con, "r", "benchmark", "v", None, "a")
            raise RuntimeError("killed before commit")
        assert con.execute("SELECT count(*) FROM speed_results").fetchone()[0] == 0
        assert ledger.completed_stages(con, "r") == {}
        with statements.transaction(con):
            writers.record_speed(con, "r", "v", [_speed(1.0)])
            ledger.mark_stage(con, "r", "benchmark", "v", None, "a")
        assert ledger.completed_stages(con, "r") == {("benchmark", "v"): None}


# --- NaN/Inf outputs -----------------------------------------------------------------------------


@pytest.mark.slow
def test_finite_weights_with_nan_outputs_fail_the_variant(tiny_model, tmp_path):
    """A real build whose saved weight scale is finite but overflows once applied (finite weights, non-finite
    outputs): the flow reuses it, lm-eval's perplexity comes out non-finite, and the variant is failed with that
    reason and rejected, and the run completes. (That one variant's failure spares the others is shown for a
    failed build in test_crash_resume.)"""
    from safetensors.torch import load_file, save_file

    from quantgate.catalog.load import load_catalog
    from quantgate.flows.evaluate_model import evaluate_model
    from quantgate.tasks.steps.download import fetch_model
    from quantgate.tasks.steps.quantize import build_variant

    cat_path = tmp_path / "catalog.yaml"
    cat_path.write_text(textwrap.dedent(f"""
        version: 1
        variants:
          rtn-w8a16: {{method: rtn, scheme: W8A16, group_size: null}}
        suites: {{stories: {{tasks: [{{name: qg_simple_stories, limit: 1}}]}}}}
        models:
          - {{id: tiny, source: {{kind: local, path: {tiny_model}}}, variants: [rtn-w8a16], suite: stories}}
        policy:
          version: 1
          quality: [{{task: qg_simple_stories, metric: bits_per_byte, min_recovery: 0.5, higher_is_better: false}}]
    """))
    cat = load_catalog(cat_path)
    spec = cat.model("tiny")
    work = tmp_path / "work"
    model = fetch_model(spec, work / "models")
    poisoned = build_variant(model, cat.variants["rtn-w8a16"], spec.calibration, work / "variants")
    weights = os.path.join(poisoned.path, "model.safetensors")
    tensors = load_file(weights)
    scale = next(k for k in tensors if k.endswith("mlp.down_proj.weight_scale") and ".0." in k)
    tensors[scale] = torch.full_like(tensors[scale], 1e38)  # finite; int8 weight x scale overflows to inf
    save_file(tensors, weights, metadata={"format": "pt"})
    assert all(torch.isfinite(t.float()).all() for t in tensors.values())

    card = evaluate_model(model="tiny", catalog=str(cat_path), warehouse=str(tmp_path / "w.ducklake"), workdir=str(work))
    by_name = {r["variant"]: r for r in card}
    bad = by_name["rtn-w8a16"]
    assert bad["decision"] == "reject" and "rtn-w8a16: outputs contain NaN/Inf (qg_simple_stories/" in bad["reason"]
    with sessions.session(tmp_path / "w.ducklake", read_only=True) as con:
        assert con.execute("SELECT status FROM runs").fetchone()[0] == "completed"
    with sessions.session(tmp_path / "w.ducklake", read_only=True) as con:
        status, error = con.execute("SELECT status, error FROM variants WHERE variant_uid = ?", [poisoned.uid]).fetchone()
        # Not measured further: no KL or speed for a variant whose outputs are garbage.
        assert con.execute("SELECT count(*) FROM quality_evals WHERE variant_uid = ?", [poisoned.uid]).fetchone()[0] == 1
    assert status == "failed" and error.startswith("rtn-w8a16: outputs contain NaN/Inf") and "\n" not in error
    shutil.rmtree(work)


def test_a_warehouse_from_before_run_stages_keeps_its_rows_and_is_never_resumed(tmp_path):
    """A DuckDB-file warehouse as migration 0004 left it (no run stages, no attempts), its run killed mid-way,
    imported into the lake: every row kept, the newer columns at their defaults, and the run never resumed."""
    import duckdb

    from quantgate.warehouse import legacy
    from tests.test_warehouse import seed_run
    from tests.test_warehouse_import import legacy_warehouse

    with sessions.session(tmp_path / "seed.ducklake") as con:
        seed_run(con, "r1")
        transfer.export_parquet(con, tmp_path / "pq")
    old = tmp_path / "old.duckdb"
    legacy_warehouse(old, tmp_path / "pq", upto=4, views=False)
    with duckdb.connect(str(old)) as con:
        con.execute("UPDATE runs SET status = 'running', finished_at = NULL")  # as if killed, before 0005
        before = {t: con.execute(f"SELECT count(*) FROM {t}").fetchone()[0] for t in ("runs", "variants",
                  "run_variants", "quality_results", "quality_samples", "speed_results")}
    path = tmp_path / "w.ducklake"
    with sessions.session(path) as con:
        legacy.import_duckdb(con, old)
        assert {t: con.execute(f"SELECT count(*) FROM {t}").fetchone()[0] for t in before} == before
        assert con.execute("SELECT resume_key FROM runs").fetchall() == [(None,)]
        assert {r for (r,) in con.execute("SELECT skipped FROM variants").fetchall()} == {False}  # 0007's default
        assert con.execute("SELECT count(*) FROM run_variants WHERE speed_key IS NOT NULL OR speed_run_id IS NOT NULL"
                           " OR speed_variant_uid IS NOT NULL").fetchone() == (0,)
    with sessions.session(path) as con:
        # Its unfinished run has no attempts to tell whether it is still at work: a rerun starts afresh.
        assert _begin(con, "a1") == ("a1", False)
        assert con.execute("SELECT status FROM runs WHERE run_id = 'r1'").fetchone()[0] == "running"


def test_nothing_is_stored_once_the_run_is_interrupted(tmp_path):
    """A stage's thread that finishes after the run's SIGINT (its build worker ended by the interrupt's cleanup, read
    as a failed build: seen on the H100, where the rerun then took the stored failure as the build's outcome) stores
    nothing: it gets the run's interrupt instead, and the rerun does the stage again. Before the signal it stores."""
    import signal
    import threading

    from quantgate.catalog.stages import Stage
    from quantgate.flows import interrupts
    from quantgate.flows.stage_run import StageRun

    wh = tmp_path / "w.ducklake"
    with sessions.session(wh) as con:
        run_id, _ = _begin(con, "a1")
    run = StageRun(str(wh), run_id, "a1")
    signalled, outcome = threading.Event(), []

    def late_stage() -> None:  # a build's thread, its result in after the signal
        signalled.wait(30)
        try:
            with run.stage(Stage.QUANTIZE, "late", "failed: worker ended"):
                pass
        except interrupts.Interrupted as e:
            outcome.append(str(e))

    with run.stage(Stage.QUANTIZE, "early"):
        pass
    thread = threading.Thread(target=late_stage)
    thread.start()
    with pytest.raises(interrupts.Interrupted), interrupts.guard():
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)  # the handler raises here
    signalled.set()
    thread.join(30)
    assert outcome == ["interrupted (SIGINT) during startup"]
    with sessions.session(wh, read_only=True) as con:
        assert set(ledger.completed_stages(con, run_id)) == {("quantize", "early")}
    with interrupts.guard():  # the next run's guard stores again
        with run.stage(Stage.QUANTIZE, "late"):
            pass
