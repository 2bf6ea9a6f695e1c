"""The GPU suite's CPU-testable parts: deadline handling, OOM fallbacks, prompts with a shared prefix,
the vLLM command-line flags, Transformers' dummy-weight and static-cache paths, and the whole flow on
a machine without a GPU (real Prefect, real DuckDB, a tiny shape)."""

from __future__ import annotations

import importlib.util
import json
import os
import threading
from pathlib import Path

import pytest
import torch
import yaml
from prefect.testing.utilities import prefect_test_harness

from quantgate.catalog.gpu_suite import SuiteStep, load_gpu_suite
from quantgate.catalog.scenarios import OfflineScenario, ServingScenario
from quantgate.flows.gpu_suite import Clock, StepOutcome, gpu_suite, run_steps, select_steps
from quantgate.tasks.adapters.engines import EngineOptions, create
from quantgate.tasks.adapters.speed.errors import BenchmarkError
from quantgate.tasks.adapters.speed.options import engine_options
from quantgate.tasks.adapters.speed.prompts import make_prompt_sets
from quantgate.tasks.adapters.speed.retry import fallback_options
from quantgate.tasks.adapters.speed.vllm_cli import looks_like_oom, root_cause, vllm_cli_args
from quantgate.tasks.runtime.launch import LaunchError, on_gpus
from quantgate.tasks.steps.benchmark import run_scenarios
from quantgate.tasks.adapters.dummy_weights import QWEN25_7B_INSTRUCT, write_dummy_checkpoint
from quantgate.warehouse import reads, sessions
from tests.shapes import TINY_QWEN

REPO = Path(__file__).resolve().parents[1]
no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks what happens on a machine without a GPU")


class FakeTime:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _step(part: str = "offline", timeout_s: float = 300) -> SuiteStep:
    return SuiteStep(part=part, engine="vllm", build="bf16", scenarios=("offline",), timeout_s=timeout_s)


def test_steps_after_the_deadline_are_skipped_and_started_ones_capped():
    now = FakeTime()
    clock = Clock(deadline_s=50, grace_s=20, now=now)
    ran, skipped, recorded = [], [], []

    def execute(index, step, timeout_s, lane):
        ran.append((index, timeout_s))
        now.t += {0: 30, 1: 25}.get(index, 0)  # the second step ends past the deadline
        if index == 1:
            raise RuntimeError("engine died\nsecond line")
        return StepOutcome("ok", None)

    outcomes = run_steps(
        [(i, _step(timeout_s=300 if i else 10)) for i in range(4)],
        clock,
        execute,
        lambda i, step, reason: skipped.append((i, reason)),
        lambda i, step, outcome, started, seconds: recorded.append((i, outcome.status, started, seconds)),
    )

    # Step 0 keeps its own 10 s limit; step 1 (started at 30 s) may run until deadline + grace = 70 s.
    assert ran == [(0, 10), (1, 40)]
    assert [o.status for o in outcomes] == ["ok", "failed", "skipped", "skipped"]
    assert outcomes[1].reason == "RuntimeError: engine died"
    assert [i for i, _ in skipped] == [2, 3]
    assert skipped[0][1] == "deadline: not started, 55 s in and deadline_s is 50"
    assert recorded == [(0, "ok", 0, 30), (1, "failed", 30, 25), (2, "skipped", None, None), (3, "skipped", None, None)]


def test_two_lanes_run_steps_side_by_side_and_wide_steps_alone_after_them():
    both_running = threading.Barrier(2, timeout=10)  # times out unless two steps run at once
    ran, lock = [], threading.Lock()

    def execute(index, step, timeout_s, lane):
        if index in (0, 2):  # the first two narrow steps
            both_running.wait()
        with lock:
            ran.append((index, lane))
        return StepOutcome("ok", None)

    steps = [(i, _step("tp2" if i == 1 else "offline")) for i in range(5)]
    outcomes = run_steps(steps, Clock(deadline_s=60, grace_s=0), execute, lambda *a: None, lambda *a: None,
                         lanes=("0", "1"), wide=lambda step: step.part == "tp2")

    assert [o.status for o in outcomes] == ["ok"] * 5
    narrow = {index: lane for index, lane in ran[:-1]}
    assert sorted(narrow) == [0, 2, 3, 4] and set(narrow.values()) == {"0", "1"}
    assert ran[-1] == (1, None)  # the tensor-parallel step waited for both lanes, then ran on all GPUs


def test_an_interrupt_on_two_lanes_ends_the_running_steps_and_starts_no_more():
    stopped, started, recorded = threading.Event(), threading.Event(), []

    def execute(index, step, timeout_s, lane):
        if index == 0:
            started.wait(10)
            raise KeyboardInterrupt  # as SIGINT from a time limit would
        started.set()
        stopped.wait(10)  # a running step, ended by `interrupt`
        return StepOutcome("failed", "GPU 1: KeyboardInterrupt")

    with pytest.raises(KeyboardInterrupt):
        run_steps([(i, _step()) for i in range(4)], Clock(deadline_s=60, grace_s=0), execute, lambda *a: None,
                  lambda i, step, outcome, *_: recorded.append((i, outcome.reason)), lanes=("0", "1"),
                  interrupt=stopped.set)

    assert stopped.is_set() and recorded == [(1, "GPU 1: KeyboardInterrupt")]  # steps 2 and 3 never started


def test_a_step_on_one_gpu_runs_in_a_process_that_sees_only_that_gpu(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    written: list[str] = []  # this process's environment is never rewritten, not even for a moment
    setitem = type(os.environ).__setitem__
    monkeypatch.setattr(type(os.environ), "__setitem__", lambda env, k, v: (written.append(k), setitem(env, k, v))[1])

    assert on_gpus("1", 60, os.getenv, "CUDA_VISIBLE_DEVICES") == "1"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1" and written == []  # this process keeps its own view
    with pytest.raises(LaunchError, match=r"^GPU 1: ValueError: invalid literal"):
        on_gpus("1", 60, int, "x")
    with pytest.raises(LaunchError, match=r"GPU 1: the process ended without an answer \(exit code 3\)"):
        on_gpus("1", 60, os._exit, 3)


def test_the_device_tests_suite_passes_the_catalog_rules_on_a_cpu(tmp_path):
    """The suite tests/gpu/ runs on the device, validated here, so that a catalog rule it breaks shows in CI and not
    first on the device (it once kept batch_size on latency scenarios after only offline ones took it)."""
    from tests.gpu.test_gpu_suite_gpu import suite_file

    suite = load_gpu_suite(suite_file(tmp_path))
    assert {s.kind for s in suite.scenarios.values()} == {"offline", "latency", "serving"}


def test_out_of_memory_starts_are_retried_with_less():
    opts = EngineOptions(device="cuda", dtype="bfloat16", max_model_len=4096, gpu_memory_utilization=0.9)

    tries = fallback_options(opts, "vllm", needed_len=384)
    assert [(t.gpu_memory_utilization, t.max_model_len) for t in tries] == [(0.9, 4096), (0.7, 4096), (0.7, 384)]
    # An engine that takes what it loads: the same start again, with the GPU alone; on a CPU, none.
    assert fallback_options(opts, "transformers", 384) == [opts, opts]
    on_cpu = EngineOptions(device="cpu", dtype="float32")
    assert fallback_options(on_cpu, "transformers", 384) == [on_cpu]
    tight = EngineOptions(device="cuda", dtype="bfloat16", max_model_len=384, gpu_memory_utilization=0.3)
    assert fallback_options(tight, "vllm", 384) == [tight]
    # vLLM 0.26's and torch's words for it; other failures are not retried.
    assert looks_like_oom(
        "ValueError: Free memory on device (10.1/139.8 GiB) on startup is less than desired GPU memory utilization"
    )
    assert looks_like_oom("ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization`")
    assert looks_like_oom("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB")
    # Another process freed GPU memory while this start profiled its own (three test workers sharing an H200).
    assert looks_like_oom("AssertionError: Error in memory profiling. Initial free memory 96.8 GiB, current free "
                          "memory 138.98 GiB. This happens when other processes sharing the same container release")
    assert not looks_like_oom("ValueError: unknown quantization method") and not looks_like_oom(None)
    # A healthy start logs the free memory too; that is not a failure.
    assert not looks_like_oom(
        "INFO Free memory on device (130.2/139.8 GiB) on startup. Desired GPU memory utilization is (0.8, 111.8 GiB)."
    )
    # The engine core's own exception, not the front end's generic one, is the cause.
    log = ("INFO loading\n(EngineCore_DP0 pid=42) Traceback (most recent call last):\n"
           "(EngineCore_DP0 pid=42) ValueError: No available memory for the cache blocks. Try increasing it\n"
           "RuntimeError: Engine core initialization failed. See root cause above.\n")
    assert root_cause(log) == "ValueError: No available memory for the cache blocks. Try increasing it"
    assert root_cause("all fine\n") is None


def test_shared_prefix_prompts_share_the_prefix_and_change_tails_per_pass(tiny_model):
    scenario = OfflineScenario(num_prompts=3, input_len=12, output_len=4, shared_prefix_len=8, device="cpu")
    sets = make_prompt_sets(scenario, str(tiny_model), 3)

    prefixes = {tuple(p[:8]) for s in sets for p in s}
    assert len(prefixes) == 1 and all(len(p) == 12 for s in sets for p in s)
    assert sets[0] != sets[1] != sets[2]  # fresh tails each pass: the cache can only reuse the prefix
    assert sets == make_prompt_sets(scenario, str(tiny_model), 3)  # seeded
    plain = make_prompt_sets(scenario.model_copy(update={"shared_prefix_len": 0}), str(tiny_model), 2)
    assert plain[0] == plain[1] and len({tuple(p[:8]) for p in plain[0]}) == 3


def test_vllm_flags_match_the_offline_engine_options():
    s = OfflineScenario(engines=["vllm"], speculative="ngram", enforce_eager=True, max_model_len=512,
                     max_cudagraph_capture_size=128, weights="dummy")
    args = vllm_cli_args(engine_options(s, "cuda", dummy_weights=True))

    def value(flag):
        return args[args.index(flag) + 1]

    assert (value("--dtype"), value("--max-model-len"), value("--load-format")) == ("bfloat16", "512", "dummy")
    assert value("--gpu-memory-utilization") == "0.8" and value("--max-cudagraph-capture-size") == "128"
    assert "--enforce-eager" in args and "--no-enable-prefix-caching" in args and "--seed" not in args
    assert value("--speculative-config") == (
        '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}')
    on = vllm_cli_args(engine_options(OfflineScenario(enable_prefix_caching=True), "cuda"))
    assert "--enable-prefix-caching" in on and "--load-format" not in on and "--enforce-eager" not in on


def test_transformers_builds_dummy_weights_and_static_cache_gives_the_same_tokens(tmp_path):
    ck = write_dummy_checkpoint(tmp_path / "bf16", {**QWEN25_7B_INSTRUCT, **TINY_QWEN}, write_weights=False)
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12]]
    tokens = []
    for compile_ in (False, True):
        engine = create("transformers")
        engine.load(str(ck.path), EngineOptions(device="cpu", dtype="float32", dummy_weights=True, compile=compile_))
        assert engine.stats() == {"compiled": compile_}
        tokens.append(engine.generate(prompts, 6).token_ids)
        engine.close()
    # Seeded random init: the same weights twice; greedy decoding over a static cache matches the dynamic one.
    assert tokens[0] == tokens[1] and [len(t) for t in tokens[0]] == [6, 6]
    # Without dummy_weights a folder without weights cannot load.
    with pytest.raises(OSError):
        create("transformers").load(str(ck.path), EngineOptions(device="cpu", dtype="float32"))


def test_scenarios_sharing_a_process_must_agree_on_engine_options(tiny_model):
    a = OfflineScenario(device="cpu")
    with pytest.raises(BenchmarkError, match="'a' and 'b' need different engine options"):
        run_scenarios(str(tiny_model), "transformers", [("a", a), ("b", a.model_copy(update={"enforce_eager": True}))])
    served = ServingScenario(engines=["vllm"], concurrency=[1])
    with pytest.raises(BenchmarkError, match="'s' is a serving scenario: run it with tasks.speed.serving.serve_scenario"):
        run_scenarios(str(tiny_model), "vllm", [("s", served)])


def _tiny_suite(tmp_path: Path) -> Path:
    """catalog/gpu.yaml with a tiny shape and two CPU steps in front, so that on a machine without a
    GPU some steps really run and the GPU ones are skipped."""
    suite = yaml.safe_load((REPO / "catalog" / "gpu.yaml").read_text())
    suite["shapes"]["tiny"] = {"preset": "qwen2.5-7b-instruct", "overrides": TINY_QWEN}
    suite["builds"]["w4a16-g32"] = {"quant": "w4a16", "group_size": 32}
    cpu = {"kind": "offline", "engines": ["transformers"], "device": "cpu", "weights": "dummy", "num_prompts": 2,
           "input_len": 8, "output_len": 4, "batch_size": 2, "warmup": 0, "repetitions": 1,
           "transformers_decompressed": True}  # the W4A16 dummy build is timed too (the suite's steps under test)
    suite["scenarios"]["cpu-offline"] = cpu
    suite["scenarios"]["cpu-latency"] = {**{k: v for k, v in cpu.items() if k != "batch_size"}, "kind": "latency"}
    suite["steps"] = [
        {"part": "cpu", "engine": "transformers", "build": "bf16", "scenarios": ["cpu-offline", "cpu-latency"]},
        {"part": "cpu", "engine": "transformers", "build": "w4a16-g32", "scenarios": ["cpu-offline"]},
        *[s for s in suite["steps"] if s["build"] == "bf16"],
    ]
    path = tmp_path / "suite.yaml"
    path.write_text(yaml.safe_dump(suite))
    return path


@pytest.fixture(scope="module")
def prefect_api():
    with prefect_test_harness():
        yield


@pytest.mark.slow
@no_gpu
@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="checks a machine without vllm")
def test_flow_on_a_cpu_machine_runs_cpu_steps_and_records_gpu_ones_as_skipped(tmp_path, prefect_api):
    suite = _tiny_suite(tmp_path)
    wh = tmp_path / "w.ducklake"

    steps = gpu_suite(warehouse=str(wh), workdir=str(tmp_path / "work"), shape="tiny", suite=str(suite))

    by_engine = [(s["engine"], s["build"], s["status"]) for s in steps]
    assert by_engine[:2] == [("transformers", "bf16", "ok"), ("transformers", "w4a16-g32", "ok")]
    assert all(s["status"] == "skipped" for s in steps[2:])
    assert {s["reason"] for s in steps[2:] if s["engine"] != "transformers"} == {
        "vllm is not installed (install the 'gpu' extra on a CUDA machine)"}
    assert {s["reason"] for s in steps[2:] if s["engine"] == "transformers"} == {
        "the scenario asks for cuda but no CUDA GPU is visible to transformers"}
    with sessions.session(wh, read_only=True) as con:
        (run,) = reads.rows(con, "SELECT * FROM runs")
        assert (run["flow_name"], run["model_id"], run["status"]) == ("gpu-suite", "tiny", "completed")
        speed = {(r["engine"], r["scenario"], r["variant_uid"].rsplit(":", 1)[1]): r
                 for r in reads.rows(con, "SELECT * FROM speed_results")}
        lat = speed[("transformers", "cpu-latency", "dummy-bf16")]
        assert lat["status"] == "ok" and lat["decode_tokens_per_s"] == pytest.approx(1000 / lat["tpot_ms"])
        assert speed[("transformers", "cpu-offline", "dummy-w4a16-g32")]["status"] == "ok"
        # Every GPU scenario has its row, skipped with the reason.
        assert speed[("vllm", "serving", "dummy-bf16")]["status"] == "skipped"
        assert speed[("vllm-bench", "offline-sampled", "dummy-bf16")]["reason"].startswith("vllm is not installed")
        assert con.execute("SELECT list(DISTINCT weights) FROM variants").fetchone()[0] == ["dummy"]
        assert con.execute("SELECT count(*) FROM quality_evals").fetchone()[0] == 0
        assert con.execute("SELECT count(*) FROM decisions").fetchone()[0] == 0
    # Only the quantized build that ran got weights written; BF16 stays without (random init on load).
    work = tmp_path / "work" / "gpu" / "tiny"
    assert "Decompressing model" in (work / "logs" / "step01" / "transformers-0.log").read_text()
    assert list((work / "w4a16-g32").glob("*.safetensors")) and not list((work / "bf16").glob("*.safetensors"))
    assert not list((work / "w4a16-g128").glob("*.safetensors"))


@pytest.mark.slow
@no_gpu
def test_flow_on_two_gpu_lanes_runs_each_step_in_its_own_process_into_one_run(tmp_path, prefect_api):
    """The lanes' plumbing on a CPU machine: the two CPU steps run side by side in processes that see one
    "GPU" each, both write the same warehouse, and the run is one run; GPU timing is for the device."""
    wh = tmp_path / "w.ducklake"

    steps = gpu_suite(warehouse=str(wh), workdir=str(tmp_path / "work"), shape="tiny", suite=str(_tiny_suite(tmp_path)),
                      parts=["cpu", "tp2"], gpus=["0", "1"])

    assert [(s["part"], s["build"], s["status"]) for s in steps] == [
        ("cpu", "bf16", "ok"), ("cpu", "w4a16-g32", "ok"), ("tp2", "bf16", "skipped")]
    with sessions.session(wh, read_only=True) as con:
        (run,) = reads.rows(con, "SELECT * FROM runs")
        assert run["status"] == "completed"
        rows = reads.rows(con, "SELECT run_id, scenario, status FROM speed_results ORDER BY scenario, variant_uid")
    assert {r["run_id"] for r in rows} == {run["run_id"]}
    assert [(r["scenario"], r["status"]) for r in rows] == [
        ("cpu-latency", "ok"), ("cpu-offline", "ok"), ("cpu-offline", "ok"), ("offline-tp2", "skipped")]
    assert list((tmp_path / "work" / "gpu" / "tiny" / "w4a16-g32").glob("*.safetensors"))


def test_flow_past_its_deadline_starts_nothing(tmp_path, prefect_api):
    wh = tmp_path / "w.ducklake"

    steps = gpu_suite(warehouse=str(wh), workdir=str(tmp_path / "work"), shape="tiny", suite=str(_tiny_suite(tmp_path)),
                      parts=["cpu", "serving"], deadline_s=0)

    assert [(s["part"], s["status"]) for s in steps] == [("cpu", "skipped"), ("cpu", "skipped"), ("serving", "skipped")]
    assert all(s["reason"].startswith("deadline: not started") for s in steps)
    with sessions.session(wh, read_only=True) as con:
        assert con.execute("SELECT count(*) FROM speed_results WHERE status = 'skipped'").fetchone()[0] == 4
        # Dummy weights of the shape: random, as a shape run's, and marked so.
        assert con.execute("SELECT model_id, random_weights FROM models").fetchall() == [("tiny", True)]
    suite = load_gpu_suite(_tiny_suite(tmp_path))
    assert [s.part for _, s in select_steps(suite, ["serving", "cpu"])] == ["serving", "cpu", "cpu"]
    with pytest.raises(Exception, match=r"unknown part\(s\) \['nope'\]"):
        gpu_suite(warehouse=str(wh), workdir=str(tmp_path / "work"), shape="tiny", suite=str(_tiny_suite(tmp_path)),
                  parts=["nope"])


def test_a_quantized_builds_random_weights_are_written_once_in_a_process_of_their_own(tmp_path):
    from quantgate.catalog.records import VariantArtifact
    from quantgate.flows.gpu_suite import MARKER, Build, ensure_weights
    from quantgate.tasks.adapters.dummy_weights import QWEN25_7B_INSTRUCT
    from tests.shapes import TINY_QWEN

    config = {**QWEN25_7B_INSTRUCT, **TINY_QWEN}
    folder = tmp_path / "w4"
    folder.mkdir()
    variant = VariantArtifact(uid="w4", model_uid="tiny@0", name="w4", method="rtn", scheme="W4A16", bits=4,
                              group_size=32, path=str(folder), recipe=None, recipe_hash=None, size_bytes=None)
    build = Build("w4", folder, "w4a16", 32, variant, {"shape": "tiny"})
    ensure_weights(build, config)
    written = {p.name: p.stat().st_mtime_ns for p in folder.glob("*.safetensors")}
    assert written and json.loads((folder / MARKER).read_text()) == {"shape": "tiny", "weights": True}
    ensure_weights(build, config)  # marked: not written again
    assert {p.name: p.stat().st_mtime_ns for p in folder.glob("*.safetensors")} == written
