"""`vllm bench throughput`, vLLM's own offline benchmark, run on an offline scenario beside our vLLM figure:
the harness cross-check (engine "vllm-bench"). Like every engine it starts beside unmeasured work and runs its
passes with the GPU alone: its program is held at its first pass until the GPU is its own, and its timed pass is
repeated as many times as ours (bench_gate.py), the median taken as ours is."""

from __future__ import annotations

import json
import os
import select
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quantgate.catalog.records import SpeedResult
from quantgate.catalog.scenarios import ScenarioSpec, bench_mismatch
from quantgate.tasks.adapters.engines import EngineOptions
from quantgate.tasks.adapters.speed.bench_gate import GATE_ENV, GO, READY, gate_env
from quantgate.tasks.adapters.speed.errors import ServingError
from quantgate.tasks.adapters.speed.options import start_memory_bytes
from quantgate.tasks.adapters.speed.preflight import preflight
from quantgate.tasks.runtime.processes import end_group, group_alive, log_tail, spawn_session
from quantgate.tasks.adapters.speed.retry import Failure, fallback_options, retry_on_oom
from quantgate.tasks.adapters.speed.vllm_cli import (
    BENCH_CLI, QUIET_ENV, bench_engine_args, bench_throughput_command, output_tokens_per_s_from_log, read_log,
    vllm_versions,
)
from quantgate.tasks.runtime import launch
from quantgate.tasks.runtime.telemetry import nvml_device_name


@dataclass(frozen=True)
class BenchLoad:
    """What one timed pass of the bench holds: its prompts and their lengths (random dataset, EOS ignored)."""

    num_prompts: int
    input_len: int
    output_len: int

    def figures(self, timed: dict[str, Any]) -> dict[str, Any]:
        """One pass as the gate timed it (its seconds and clocks), counted as vLLM's bench counts its tokens."""
        seconds = timed["seconds"]
        clocks = {k: v for k, v in timed.items() if k != "seconds"}
        return {"wall_s": seconds, "tokens_per_s": self.num_prompts * self.output_len / seconds,
                "total_tokens_per_s": self.num_prompts * (self.input_len + self.output_len) / seconds,
                "requests_per_s": self.num_prompts / seconds, **clocks}


class StartedBench:
    """A `vllm bench throughput` whose engine has started and whose first pass waits
    (tasks/adapters/speed/bench_gate.py): `measure()` lets it run its passes and reads its numbers; leaving the block
    ends its process group."""

    def __init__(self, proc: subprocess.Popen, go_fd: int, cmd: list[str], out_json: Path, log: Path,
                 load: BenchLoad, times_file: Path) -> None:
        self.proc, self._go_fd, self.cmd, self._out_json, self.log = proc, go_fd, cmd, out_json, log
        self._load, self._times_file = load, times_file

    @property
    def pid(self) -> int:
        return self.proc.pid

    def measure(self, timeout_s: float) -> dict[str, Any]:
        os.write(self._go_fd, GO)
        self._close_go()
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise ServingError(f"vllm bench throughput ran past {timeout_s:.0f}s (log {self.log})") from None
        if self.proc.returncode != 0 or not self._out_json.exists():
            raise ServingError(f"vllm bench throughput failed (exit {self.proc.returncode}): {log_tail(self.log)}")
        data = json.loads(self._out_json.read_text())
        try:
            passes = [self._load.figures(t) for t in json.loads(self._times_file.read_text())]
        except (OSError, ValueError, KeyError, TypeError):
            raise ServingError(f"vllm bench throughput left no pass times in {self._times_file}") from None
        # vLLM's own timing spans every pass: its mean over them, beside the median of the passes the gate timed.
        own = output_tokens_per_s_from_log(read_log(self.log))
        return {
            "output_tokens_per_s": statistics.median(p["tokens_per_s"] for p in passes),
            "total_tokens_per_s": statistics.median(p["total_tokens_per_s"] for p in passes),
            "requests_per_s": statistics.median(p["requests_per_s"] for p in passes),
            "repetitions": passes,
            "own_mean_output_tokens_per_s": own * len(passes) if own is not None else None,
            "elapsed_s": data["elapsed_time"],
            "num_requests": data["num_requests"],
            "total_num_tokens": data["total_num_tokens"],
            "command": self.cmd,
        }

    def __enter__(self) -> StartedBench:
        return self

    def __exit__(self, *exc: object) -> None:
        self._close_go()  # without its go, a bench still held ends itself
        if group_alive(self.proc.pid):
            end_group(self.proc, grace_s=10)

    def _close_go(self) -> None:
        if self._go_fd >= 0:
            os.close(self._go_fd)
            self._go_fd = -1


def start_bench(
    model_path: str,
    *,
    input_len: int,
    output_len: int,
    num_prompts: int,
    work_dir: str | Path,
    seed: int = 0,
    num_warmups: int = 0,
    passes: int = 1,
    extra_args: Sequence[str] = (),
    env: dict[str, str] | None = None,
    ready_timeout_s: float = 1800.0,
    niceness: int = 0,
    cli: Sequence[str] = BENCH_CLI,
) -> StartedBench:
    """Start `vllm bench throughput` on the random dataset (EOS ignored, fixed lengths), `num_warmups` warm-up
    prompts and its timed pass run `passes` times, and return once its engine is up and its first pass waits; a bench
    that ends or runs out of time before that raises ServingError with its log's tail. Engine flags (--dtype,
    --max-model-len, --load-format dummy ...) go in `extra_args`."""
    work = Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    out_json = work / "vllm_bench_throughput.json"
    log = work / "vllm_bench_throughput.log"
    times_file = work / "pass_seconds.json"
    for stale in (out_json, times_file):
        stale.unlink(missing_ok=True)
    if num_warmups:
        extra_args = [*extra_args, "--num-warmups", str(num_warmups)]
    cmd = bench_throughput_command(model_path, input_len=input_len, output_len=output_len, num_prompts=num_prompts,
                                   seed=seed, output_json=out_json, extra_args=extra_args, cli=cli)
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    try:
        gate = gate_env(ready_w, go_r, 2 if num_warmups else 1, passes, str(times_file))
        proc = spawn_session(cmd, log, {**(env or {}), GATE_ENV: gate}, niceness=niceness, pass_fds=(ready_w, go_r),
                             defaults=QUIET_ENV)
    except BaseException:
        for fd in (ready_r, ready_w, go_r, go_w):
            os.close(fd)
        raise
    os.close(ready_w)
    os.close(go_r)
    bench = StartedBench(proc, go_w, cmd, out_json, log, BenchLoad(num_prompts, input_len, output_len), times_file)
    try:
        readable, _, _ = select.select([ready_r], [], [], max(0.0, ready_timeout_s))
        said = os.read(ready_r, len(READY)) if readable else None
    finally:
        os.close(ready_r)
    if said == READY:
        return bench
    with bench:
        if said is None:
            raise ServingError(f"vllm bench throughput did not reach its first pass within {ready_timeout_s:.0f}s "
                               f"(log {log})")
        proc.wait()
        raise ServingError(f"vllm bench throughput failed before its first pass (exit {proc.returncode}): "
                           f"{log_tail(log)}")


def vllm_bench_throughput(model_path: str, *, timeout_s: float = 1800.0, **start: Any) -> dict[str, Any]:
    """`vllm bench throughput` from start to end, its passes right after its start: the median of its timed passes
    (output tokens/s, total (prompt + output) tokens/s, requests/s), each pass, vLLM's own mean over them, and its
    command. `start` takes start_bench's keywords."""
    deadline = time.monotonic() + timeout_s
    with start_bench(model_path, ready_timeout_s=timeout_s, **start) as bench:
        return bench.measure(max(1.0, deadline - time.monotonic()))


@dataclass(frozen=True)
class _BenchStart:
    """One start of a scenario's bench, as the out-of-memory retry calls it (retry_on_oom): beside unmeasured work, at
    its lower CPU priority, like every engine's, its passes with the GPU alone; a retry after running out of memory
    starts with the GPU alone, nothing else loading."""

    model_path: str
    scenario_name: str
    scenario: ScenarioSpec
    work_dir: Path
    deadline: launch.Deadline

    def __call__(self, used: EngineOptions, tried: int) -> dict[str, Any] | Failure:
        bench_dir = self.work_dir / f"bench-{self.scenario_name}-{tried}"
        slot = launch.Slot.for_try(f"vllm bench on {Path(self.model_path).name}",
                                   start_memory_bytes(used, self.model_path, "vllm"), tried)
        try:
            return launch.start_then_measure(slot, lambda niceness: self._begin(used, bench_dir, niceness),
                                             self._measure)
        except (ServingError, launch.GpuMemoryError) as e:  # the latter raised before the start: its line is why
            return Failure(str(e), bench_dir / "vllm_bench_throughput.log")

    def _begin(self, used: EngineOptions, bench_dir: Path, niceness: int) -> StartedBench:
        scenario = self.scenario
        return start_bench(self.model_path, input_len=scenario.input_len, output_len=scenario.output_len,
                           num_prompts=scenario.num_prompts, work_dir=bench_dir, seed=used.seed,
                           num_warmups=scenario.num_prompts if scenario.warmup else 0,
                           passes=scenario.repetitions, extra_args=bench_engine_args(used),
                           ready_timeout_s=self.deadline.left(), niceness=niceness)

    def _measure(self, bench: StartedBench, window: launch.GpuWindow) -> dict[str, Any]:
        res = bench.measure(self.deadline.left())
        return {**res, "window": window.details()}


def bench_scenario(
    model_path: str,
    scenario_name: str,
    scenario: ScenarioSpec,
    *,
    work_dir: str | Path,
    timeout_s: float = 900.0,
    options: dict[str, Any] | None = None,
) -> SpeedResult:
    """`vllm bench throughput` on an offline scenario's config (same model, lengths, prompt count,
    engine flags, warm-up of one full pass, repetitions, sampler: the scenario must sample at the bench's fixed
    temperature, else the row is skipped with why), as a SpeedResult of engine "vllm-bench": tokens_per_s is
    the median output tokens/s of its passes and total_tokens_per_s their (prompt + output) tokens/s, like ours.
    Its window with the GPU alone holds its warm-up and timed passes and its teardown, not its start."""
    opts, result, early = preflight("vllm-bench", model_path, scenario_name, scenario, options)
    if early is not None:
        return early
    if (why := bench_mismatch(scenario)) is not None:
        return result("skipped", why, opts)
    deadline = launch.Deadline(timeout_s)
    start = _BenchStart(model_path, scenario_name, scenario, Path(work_dir), deadline)
    tried = retry_on_oom(fallback_options(opts, "vllm", scenario.input_len + scenario.output_len), deadline, start)
    used, attempts, res = tried.used, tried.attempts, tried.value
    if res is None:
        return result("failed", tried.error, used, details={"attempts": attempts})
    return result(
        "ok",
        None,
        used,
        device=nvml_device_name(),
        num_requests=res["num_requests"],
        input_tokens=scenario.num_prompts * scenario.input_len,
        output_tokens=scenario.num_prompts * scenario.output_len,
        tokens_per_s=res["output_tokens_per_s"],
        total_tokens_per_s=res["total_tokens_per_s"],
        requests_per_s=res["requests_per_s"],
        repetitions=res["repetitions"],
        versions=vllm_versions(),
        details={"command": res["command"], "elapsed_s": res["elapsed_s"], "engine_starts": tried.engine_starts,
                 "own_mean_output_tokens_per_s": res["own_mean_output_tokens_per_s"],
                 "total_num_tokens": res["total_num_tokens"], **res["window"],
                 **({"attempts": attempts} if attempts else {})},
    )


def measure_bench(model_path: str, engine: str, scenarios: Sequence[tuple[str, ScenarioSpec]], *, work_dir: Path,
                  timeout_s: float | None, pair_with: str | None,
                  on_point: Callable[[SpeedResult, list[Any]], None] | None) -> list[tuple[SpeedResult, list[Any]]]:
    """The `vllm-bench` backend of tasks/steps/measure.py: one bench per scenario (its own engine start); the bench
    has no session to pair a base with."""
    out = []
    for name, scenario in scenarios:
        result = bench_scenario(model_path, name, scenario, work_dir=work_dir,
                                **({"timeout_s": timeout_s} if timeout_s else {}))
        if on_point:
            on_point(result, [])
        out.append((result, []))
    return out
