"""`vllm bench throughput`, vLLM's own offline benchmark, run on an offline scenario beside our vLLM figure:
the harness cross-check (engine "vllm-bench")."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from quantgate.catalog.schema import ScenarioSpec, bench_mismatch
from quantgate.tasks import launch
from quantgate.tasks.engines import EngineOptions
from quantgate.tasks.records import SpeedResult
from quantgate.tasks.speed.errors import ServingError
from quantgate.tasks.speed.preflight import preflight
from quantgate.tasks.speed.processes import end_group, group_alive, log_tail, spawn_session
from quantgate.tasks.speed.retry import Failure, fallback_options, retry_on_oom
from quantgate.tasks.speed.vllm_cli import (
    VLLM_CLI,
    bench_engine_args,
    bench_throughput_command,
    output_tokens_per_s_from_log,
    read_log,
    vllm_versions,
)
from quantgate.tasks.telemetry import nvml_device_name


def vllm_bench_throughput(
    model_path: str,
    *,
    input_len: int,
    output_len: int,
    num_prompts: int,
    work_dir: str | Path,
    seed: int = 0,
    extra_args: Sequence[str] = (),
    env: dict[str, str] | None = None,
    timeout_s: float = 1800.0,
    cli: Sequence[str] = VLLM_CLI,
) -> dict[str, Any]:
    """Run `vllm bench throughput` on the random dataset (EOS ignored, fixed lengths) and return its
    numbers. vLLM's JSON has requests/s and total (prompt + output) tokens/s; output tokens/s comes
    from its printed summary line. Engine flags (--dtype, --max-model-len, --load-format dummy ...)
    go in `extra_args`."""
    work = Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    out_json = work / "vllm_bench_throughput.json"
    log = work / "vllm_bench_throughput.log"
    out_json.unlink(missing_ok=True)
    cmd = bench_throughput_command(model_path, input_len=input_len, output_len=output_len, num_prompts=num_prompts,
                                   seed=seed, output_json=out_json, extra_args=extra_args, cli=cli)
    proc = spawn_session(cmd, log, env)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        end_group(proc, grace_s=10)
        raise ServingError(f"vllm bench throughput ran past {timeout_s:.0f}s (log {log})") from None
    finally:
        if group_alive(proc.pid):
            end_group(proc, grace_s=10)
    if proc.returncode != 0 or not out_json.exists():
        raise ServingError(f"vllm bench throughput failed (exit {proc.returncode}): {log_tail(log)}")
    data = json.loads(out_json.read_text())
    output_tps = output_tokens_per_s_from_log(read_log(log))
    return {
        "requests_per_s": data["requests_per_second"],
        "total_tokens_per_s": data["tokens_per_second"],
        "output_tokens_per_s": output_tps if output_tps is not None else num_prompts * output_len / data["elapsed_time"],
        "elapsed_s": data["elapsed_time"],
        "num_requests": data["num_requests"],
        "total_num_tokens": data["total_num_tokens"],
        "command": cmd,
    }


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
    engine flags, warm-up of one full pass, sampler: the scenario must sample at the bench's fixed
    temperature, else the row is skipped with why), as a SpeedResult of engine "vllm-bench": tokens_per_s is
    its output tokens/s and total_tokens_per_s its (prompt + output) tokens/s, like ours."""
    opts, result, early = preflight("vllm-bench", model_path, scenario_name, scenario, options)
    if early is not None:
        return early
    if (why := bench_mismatch(scenario)) is not None:
        return result("skipped", why, opts)
    deadline = time.monotonic() + timeout_s

    def start(used: EngineOptions, tried: int) -> dict[str, Any] | Failure:
        bench_dir = Path(work_dir) / f"bench-{scenario_name}-{tried}"
        try:
            # Its start and its measurement are one command: both with the GPU alone.
            with launch.measuring() as window:
                res = vllm_bench_throughput(
                    model_path,
                    input_len=scenario.input_len,
                    output_len=scenario.output_len,
                    num_prompts=scenario.num_prompts,
                    work_dir=bench_dir,
                    seed=used.seed,
                    extra_args=bench_engine_args(used, scenario.num_prompts if scenario.warmup else 0),
                    timeout_s=max(1.0, deadline + window.waited_s - time.monotonic()),
                )
                return {**res, "window": window.details()}
        except ServingError as e:
            return Failure(str(e), bench_dir / "vllm_bench_throughput.log")

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
        versions=vllm_versions(),
        details={"command": res["command"], "elapsed_s": res["elapsed_s"], "engine_starts": tried.engine_starts,
                 "total_num_tokens": res["total_num_tokens"], **res["window"],
                 **({"attempts": attempts} if attempts else {})},
    )


bench_task = task(bench_scenario, name="vllm-bench", tags=["benchmark"], cache_policy=NO_CACHE)
