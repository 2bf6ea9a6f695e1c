"""`vllm bench throughput` through its gate (tasks/adapters/speed/bench_gate.py): started, held at its first
pass, let go.

vLLM cannot run here (no GPU), so a stand-in `vllm` package, first on the bench's PYTHONPATH, plays the parts the
gate touches: `vllm.LLM` (its load and `generate`, a pass of PASS_S seconds, each recorded with the time) and vLLM's
command line (`vllm.entrypoints.cli.main:main`), which does what `vllm bench throughput` does in 0.26: builds the
LLM, runs `--num-warmups` prompts, times one `generate` of `--num-prompts` with perf_counter, writes `--output-json`
and prints its summary line. The gate, the pipes, the process handling, the parsing and the GPU clock are the real
code; that
the real bench calls `LLM.generate` for its warm-up and its timed pass is vLLM 0.26's `run_vllm`
(vllm/benchmarks/throughput.py), run on the device by tests/test_serving.py's GPU test.
"""

from __future__ import annotations

import json
import statistics
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from quantgate.catalog.records import SpeedResult
from quantgate.catalog.scenarios import scenario_from
from quantgate.tasks.adapters.engines import EngineOptions
from quantgate.tasks.adapters.speed import bench as bench_module
from quantgate.tasks.adapters.speed.bench import bench_scenario, start_bench, vllm_bench_throughput
from quantgate.tasks.adapters.speed.bench_gate import GATE_ENV
from quantgate.tasks.adapters.speed.errors import ServingError
from quantgate.tasks.runtime.processes import group_alive
from quantgate.tasks.runtime import launch

PASS_S = 0.1
_LLM = textwrap.dedent(
    """
    import json, os, pathlib, time

    def _note(**event):
        with pathlib.Path(os.environ["STAND_IN_RECORD"]).open("a") as f:
            f.write(json.dumps({**event, "t": time.time()}) + "\\n")

    class LLM:
        def __init__(self, **kwargs):
            _note(event="loaded", gate_env=os.environ.get("%s"))

        def generate(self, prompts, params=None, **kwargs):
            _note(event="pass", prompts=len(prompts))
            time.sleep(%s)
            return [None] * len(prompts)
    """ % (GATE_ENV, PASS_S)
)

_CLI = textwrap.dedent(
    """
    import argparse, json, sys, time

    def main():
        parser = argparse.ArgumentParser()
        parser.add_argument("bench"); parser.add_argument("throughput")
        for flag in ("--model", "--output-json"):
            parser.add_argument(flag)
        for flag in ("--num-prompts", "--random-input-len", "--random-output-len", "--num-warmups"):
            parser.add_argument(flag, type=int, default=0)
        args, _ = parser.parse_known_args(sys.argv[1:])
        if args.model == "broken":
            print("ValueError: no such model"); sys.exit(1)
        from vllm import LLM
        llm = LLM(model=args.model)
        if args.num_warmups:
            llm.generate([[0]] * args.num_warmups)
        n, i, o = args.num_prompts, args.random_input_len, args.random_output_len
        start = time.perf_counter()
        llm.generate([[0] * i] * n)
        elapsed = time.perf_counter() - start
        json.dump({"elapsed_time": elapsed, "num_requests": n, "total_num_tokens": n * (i + o),
                   "requests_per_second": n / elapsed, "tokens_per_second": n * (i + o) / elapsed},
                  open(args.output_json, "w"))
        print(f"Throughput: {n / elapsed:.2f} requests/s, {n * (i + o) / elapsed:.2f} total tokens/s, "
              f"{n * o / elapsed:.2f} output tokens/s")
    """
)


@pytest.fixture
def record(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "stand-in"
    cli = root / "vllm" / "entrypoints" / "cli"
    cli.mkdir(parents=True)
    (root / "vllm" / "__init__.py").write_text(_LLM)
    (root / "vllm" / "entrypoints" / "__init__.py").write_text("")
    (cli / "__init__.py").write_text("")
    (cli / "main.py").write_text(_CLI)
    path = tmp_path / "record.jsonl"
    # The bench inherits this process's environment (as it does in a run).
    monkeypatch.setenv("PYTHONPATH", str(root))
    monkeypatch.setenv("STAND_IN_RECORD", str(path))
    return path


def _events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_the_bench_waits_at_its_first_pass_until_told_to_go_and_repeats_its_timed_pass(tmp_path, record):
    with start_bench("/m", input_len=32, output_len=16, num_prompts=10, work_dir=tmp_path / "b", num_warmups=10,
                     passes=3, ready_timeout_s=60) as bench:
        events = _events(record)
        assert [e["event"] for e in events] == ["loaded"]  # started, no pass run
        assert events[0]["gate_env"] is None  # popped before the engine's children could see it
        time.sleep(0.5)
        assert len(_events(record)) == 1  # still held
        let_go = time.time()
        res = bench.measure(timeout_s=60)
    passes = [e for e in _events(record) if e["event"] == "pass"]
    assert [p["prompts"] for p in passes] == [10, 10, 10, 10]  # the warm-up, then the timed pass three times
    assert all(p["t"] >= let_go for p in passes)
    reps = res["repetitions"]
    assert len(reps) == 3 and all(r["wall_s"] >= PASS_S for r in reps)
    # Each pass's clocks, read in the bench's own process as ours are (a stand-in pass sleeps: little CPU of its own).
    for r in reps:
        assert 0 <= r["front_cpu_s"] <= r["cpu_s"] + 0.05 and r["front_cpu_s"] < r["wall_s"]
        assert r["other_cpu_s"] >= 0 and r["steal_s"] >= 0 and r["gc_collections"] >= 0
    assert res["output_tokens_per_s"] == pytest.approx(statistics.median(10 * 16 / r["wall_s"] for r in reps))
    assert res["total_tokens_per_s"] == pytest.approx(statistics.median(10 * 48 / r["wall_s"] for r in reps))
    assert res["requests_per_s"] == pytest.approx(statistics.median(10 / r["wall_s"] for r in reps))
    # vLLM's own timing spans the three passes: its figure times three is its mean, the passes' within it.
    assert res["elapsed_s"] >= sum(r["wall_s"] for r in reps)
    assert res["own_mean_output_tokens_per_s"] == pytest.approx(3 * 10 * 16 / res["elapsed_s"], rel=1e-3)
    cmd = res["command"]
    assert cmd[:3] == [sys.executable, "-m", "quantgate.tasks.adapters.speed.bench_gate"]
    assert cmd[3:5] == ["bench", "throughput"] and cmd[cmd.index("--random-range-ratio") + 1] == "0"


def test_a_bench_let_go_of_without_its_go_ends_and_runs_no_pass(tmp_path, record):
    with start_bench("/m", input_len=8, output_len=8, num_prompts=4, work_dir=tmp_path / "b",
                     ready_timeout_s=60) as bench:
        pid = bench.pid
    deadline = time.monotonic() + 20
    while group_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not group_alive(pid)
    assert [e["event"] for e in _events(record)] == ["loaded"]


def test_a_bench_that_fails_before_its_first_pass_says_why(tmp_path, record):
    with pytest.raises(ServingError, match=r"failed before its first pass \(exit 1\).*no such model"):
        start_bench("broken", input_len=8, output_len=8, num_prompts=1, work_dir=tmp_path / "b", ready_timeout_s=60)
    res = vllm_bench_throughput("/m", input_len=8, output_len=4, num_prompts=2, work_dir=tmp_path / "c",
                                extra_args=["--dtype", "bfloat16"])
    assert res["num_requests"] == 2 and res["command"][-2:] == ["--dtype", "bfloat16"]


def test_under_a_gpu_clock_the_bench_starts_beside_shared_work_and_measures_alone(tmp_path, record, monkeypatch):
    """A build holds the GPU as shared work: the bench starts meanwhile, and its passes wait for the build."""
    scenario = scenario_from({"engines": ["vllm", "vllm-bench"], "num_prompts": 6, "input_len": 16, "output_len": 8,
                              "temperature": 1.0, "prompt_input": "text", "device": "cuda"})
    opts = EngineOptions(device="cuda", dtype="bfloat16")

    def preflight(engine, model_path, name, spec, options):
        return opts, lambda status, reason, used, **m: SpeedResult(engine, name, status, reason, {}, **m), None

    monkeypatch.setattr(bench_module, "preflight", preflight)
    model = tmp_path / "model"
    model.mkdir()
    build_running, build_done = threading.Event(), threading.Event()
    with launch.gpu_clock():
        def build() -> None:
            with launch.sharing():
                build_running.set()
                build_done.wait(60)

        builder = launch.beside(build)
        assert build_running.wait(10)
        measured = launch.beside(
            lambda: bench_scenario(str(model), "s", scenario, work_dir=tmp_path / "w", timeout_s=120))
        deadline = time.monotonic() + 60
        while not _events(record) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [e["event"] for e in _events(record)] == ["loaded"]  # started beside the build
        time.sleep(0.5)
        assert len(_events(record)) == 1 and not measured.done()  # its passes wait for the GPU alone
        build_ended = time.time()
        build_done.set()
        builder.result(10)
        row = measured.result(60)
    assert row.status == "ok", row.reason
    # The scenario's one warm-up and three repetitions (its defaults), as ours are run.
    assert len(row.repetitions) == 3
    assert row.tokens_per_s == pytest.approx(statistics.median(6 * 8 / r["wall_s"] for r in row.repetitions))
    passes = [e for e in _events(record) if e["event"] == "pass"]
    assert len(passes) == 4 and all(p["t"] >= build_ended for p in passes)
    assert row.details["gpu_wait_s"] >= 0.4 and row.details["engine_starts"] == 1
