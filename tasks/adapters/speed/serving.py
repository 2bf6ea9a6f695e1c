"""The serving scenario: one `vllm serve` per scenario (and per out-of-memory retry), driven through each
load in order by the streaming client; also the loads against any OpenAI-compatible server
(tasks/adapters/endpoint.py)."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quantgate.catalog.records import RequestRecord, ServingLoad, Slo, SpeedResult
from quantgate.catalog.scenarios import ServingScenario
from quantgate.tasks.adapters.engines import EngineOptions
from quantgate.tasks.adapters.speed.checkpoint import text_config
from quantgate.tasks.adapters.speed.client import run_load
from quantgate.tasks.adapters.speed.errors import ServingError
from quantgate.tasks.adapters.speed.metrics import summarize
from quantgate.tasks.adapters.speed.options import start_memory_bytes
from quantgate.tasks.adapters.speed.preflight import preflight
from quantgate.tasks.adapters.speed.prompts import make_prompts
from quantgate.tasks.adapters.speed.retry import Failure, Retried, fallback_options, retry_on_oom
from quantgate.tasks.adapters.speed.server import ServerHandle, start_server
from quantgate.tasks.adapters.speed.vllm_cli import (
    compile_cache_from_log, kernel_from_log, kv_cache_tokens_from_log, serve_engine_args, vllm_versions,
)
from quantgate.tasks.runtime import launch
from quantgate.tasks.runtime.telemetry import Telemetry, nvml_device_name
from quantgate.tasks.adapters.roofline import kv_bytes_per_token


# A scenario's loads in order: (label, concurrency, request rate, requests) each (ServingScenario.load_sizes).
_Sizes = list[tuple[str, int | None, float | None, int]]


@dataclass(frozen=True)
class _Served:
    """What one `vllm serve` that started gave: its loads, the memory peaks while it ran, its log."""

    loads: list[ServingLoad]
    peak_memory_bytes: int | None
    nvml_peak_bytes: int | None
    log: Path
    window: dict[str, Any]  # its time with the GPU alone (launch.GpuWindow.details)


@dataclass(frozen=True)
class _ServerStart:
    """One start of a serving scenario's `vllm serve`, as the out-of-memory retry calls it (retry_on_oom): beside
    unmeasured work at its lower CPU priority, once the GPU has the memory it will take; a retry after running out of
    memory starts with the GPU alone, nothing else loading. Its loads run with the GPU alone (`_measure`)."""

    model_path: str
    scenario_name: str
    scenario: ServingScenario
    sizes: _Sizes
    prompts: Sequence[list[int] | str]
    work: Path
    extra_args: Sequence[str]
    env: dict[str, str] | None
    deadline: launch.Deadline

    def __call__(self, used: EngineOptions, tried: int) -> _Served | Failure:
        log = self.work / f"serve-{self.scenario_name}-{tried}.log"
        slot = launch.Slot.for_try(f"vllm serve on {Path(self.model_path).name}",
                                   start_memory_bytes(used, self.model_path, "vllm"), tried)
        try:
            return launch.start_then_measure(slot, lambda niceness: self._serve(used, log, niceness),
                                             lambda server, window: self._measure(server, window, log))
        except (ServingError, launch.GpuMemoryError) as e:  # the latter raised before the start: its line is why
            return Failure(str(e), log)

    def _serve(self, used: EngineOptions, log: Path, niceness: int = 0) -> ServerHandle:
        return start_server(self.model_path, extra_args=serve_engine_args(used, self.extra_args), env=self.env,
                            log_path=log, ready_timeout_s=self.deadline.left(), niceness=niceness)

    def _measure(self, server: ServerHandle, window: launch.GpuWindow, log: Path) -> _Served:
        """The loads, with the GPU alone, and the server stopped before it is given back; the time waited for the
        GPU is not the loads' (the deadline moves by it: launch.Deadline)."""
        try:
            # The memory of the server's process group: idle engines of other jobs may hold some of the GPU.
            # Its peaks are read while NVML is open and the server is up.
            with Telemetry("cuda", group=server.pid) as telemetry, telemetry.still():
                loads = drive_loads(server, self.scenario, self.sizes, self.prompts, telemetry, self.deadline.at())
                return _Served(loads, telemetry.peak_memory_bytes, telemetry.nvml_peak_bytes, log, window.details())
        finally:
            server.stop()


def serve_scenario(
    model_path: str,
    scenario_name: str,
    scenario: ServingScenario,
    *,
    work_dir: str | Path,
    timeout_s: float = 900.0,
    options: dict[str, Any] | None = None,
    extra_args: Sequence[str] = (),
    env: dict[str, str] | None = None,
) -> tuple[SpeedResult, list[ServingLoad]]:
    """Start one `vllm serve` for the scenario, drive it through every load in order, stop it (its
    process group, by PID). Never raises for server trouble: the result says skipped or failed.

    The SpeedResult sums the loads: tokens_per_s is the best load's output tokens/s, energy per token
    is over all loads; repetitions holds each load's summary. Per-request rows are in the loads.
    """
    opts, result, early = preflight("vllm", model_path, scenario_name, scenario, options)
    if early is not None:
        return early, []
    sizes = scenario.load_sizes()
    prompts = make_prompts(scenario.model_copy(update={"num_prompts": max(n for *_, n in sizes)}), model_path)
    slo = Slo(**scenario.slo.model_dump()) if scenario.slo else None
    deadline = launch.Deadline(timeout_s)
    start = _ServerStart(model_path, scenario_name, scenario, sizes, prompts, Path(work_dir), extra_args, env, deadline)
    tried = retry_on_oom(fallback_options(opts, "vllm", scenario.input_len + scenario.output_len), deadline, start)
    if tried.value is None:
        details: dict[str, Any] = {"attempts": tried.attempts, "engine_starts": tried.engine_starts}
        if not tried.exhausted:
            details["log"] = str(tried.log)
        return result("failed", tried.error, tried.used, details=details), []
    return _served_result(result, tried, model_path, sizes, slo, extra_args, env)


def _served_result(
    result: Callable[..., SpeedResult],
    tried: Retried[_Served],
    model_path: str,
    sizes: _Sizes,
    slo: Slo | None,
    extra_args: Sequence[str],
    env: dict[str, str] | None,
) -> tuple[SpeedResult, list[ServingLoad]]:
    """The row of a server that started, from its loads: failed when no load ran or no request succeeded, else the
    best load's figures, energy over all loads, and the KV cache its log names."""
    served, used = tried.value, tried.used
    assert served is not None
    loads = served.loads
    summaries = [{"load": load.label, **summarize(load.records, load.duration_s, slo)} for load in loads]
    ok = [r for load in loads for r in load.records if r.success]
    if not loads:
        return result("failed", "the time was up before the first load", used,
                      details={"engine_starts": tried.engine_starts}), loads
    if not ok:
        first_error = next((r.error for load in loads for r in load.records if r.error), None)
        return result("failed", f"no request succeeded: {first_error}", used, repetitions=summaries,
                      details={"engine_starts": tried.engine_starts}), loads
    best = max(summaries, key=lambda s: s["output_tokens_per_s"])
    energies = [load.energy_j for load in loads]
    out_tokens = sum(r.output_tokens for r in ok)
    kv_tokens = kv_cache_tokens_from_log(served.log)
    config = text_config(model_path)
    return result(
        "ok",
        None,
        used,
        device=nvml_device_name(),
        num_requests=sum(len(load.records) for load in loads),
        input_tokens=sum(r.prompt_len for r in ok),
        output_tokens=out_tokens,
        tokens_per_s=best["output_tokens_per_s"],
        total_tokens_per_s=best["total_tokens_per_s"],
        requests_per_s=best["requests_per_s"],
        peak_memory_bytes=served.peak_memory_bytes,
        nvml_peak_bytes=served.nvml_peak_bytes,
        energy_j_per_token=sum(energies) / out_tokens if None not in energies and out_tokens else None,
        kv_cache_tokens=kv_tokens,
        kv_cache_bytes=kv_tokens * kv_bytes_per_token(config, 4 if used.dtype == "float32" else 2)
        if kv_tokens and config else None,
        repetitions=summaries,
        versions=vllm_versions(),
        details=_served_details(tried, best["load"], sizes, extra_args, env),
    ), loads


def _served_details(tried: Retried[_Served], best_load: str, sizes: _Sizes, extra_args: Sequence[str],
                    env: dict[str, str] | None) -> dict[str, Any]:
    """What a served row says of its run: the best load, the log, the starts and the GPU window; the server's own
    arguments where the sweep gave some, the kernel and compile cache its log names, the failed tries, and the loads
    the time did not reach."""
    served = tried.value
    assert served is not None
    log = served.log
    details: dict[str, Any] = {"best_load": best_load, "log": str(log), "engine_starts": tried.engine_starts,
                               **served.window}
    if extra_args or env:
        details["serve_args"] = list(extra_args)
        details["serve_env"] = dict(env or {})
    if kernel := kernel_from_log(log):
        details["kernel"] = kernel
    if compiled := compile_cache_from_log(log):
        details["compile_cache"] = compiled
    if tried.attempts:
        details["attempts"] = tried.attempts
    if len(served.loads) < len(sizes):
        details["loads_not_run"] = [label for label, *_ in sizes[len(served.loads) :]]
    return details


def drive_loads(
    server: ServerHandle,
    scenario: ServingScenario,
    sizes: list[tuple[str, int | None, float | None, int]],
    prompts: Sequence[list[int] | str],
    telemetry: Telemetry,
    deadline: float,
) -> list[ServingLoad]:
    """Run the loads in order until the time is up; those not started are left out."""
    if deadline <= time.monotonic():
        return []
    return run_loads(server.base_url, server.model, scenario, sizes, prompts, telemetry, deadline)


def run_loads(
    base_url: str,
    model: str | None,
    scenario: ServingScenario,
    sizes: list[tuple[str, int | None, float | None, int]],
    prompts: Sequence[list[int] | str],
    telemetry: Telemetry | None,
    deadline: float,
    **client: Any,
) -> list[ServingLoad]:
    """The loads of a serving scenario against any OpenAI-compatible server at `base_url`, in order,
    until the time is up; `client` goes to run_load (headers, vllm_extras)."""
    loads = []
    for label, concurrency, rate, n in sizes:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        before = telemetry.energy_mj() if telemetry else None
        run = run_load(
            base_url,
            list(prompts[:n]),
            scenario.output_len,
            max_concurrency=concurrency,
            request_rate=rate or math.inf,
            seed=scenario.seed,
            model=model,
            warmup=scenario.warmup,
            timeout_s=remaining,
            sampling=scenario.sampling,
            **client,
        )
        after = telemetry.energy_mj() if telemetry else None
        energy = (after - before) / 1000 if before is not None and after is not None and after > before else None
        loads.append(ServingLoad(label, concurrency, rate, run.records, run.duration_s, energy, run.server_info))
    return loads


def measured_to_dict(result: SpeedResult, loads: list[ServingLoad]) -> dict[str, Any]:
    """A speed row and its serving loads (none for an engine run) as JSON-ready data, for a GPU step's result file."""
    return {"result": result.as_dict(), "loads": [dataclasses.asdict(load) for load in loads]}


def measured_from_dict(data: dict[str, Any]) -> tuple[SpeedResult, list[ServingLoad]]:
    loads = [ServingLoad(**{**load, "records": [RequestRecord(**r) for r in load["records"]]}) for load in data["loads"]]
    return SpeedResult(**data["result"]), loads

