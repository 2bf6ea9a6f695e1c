"""Offline and latency speed of one checkpoint: engine × scenarios, each engine in a fresh spawned process
(tasks/runtime/launch.in_process_group), its start retried with less memory when it runs out
(tasks/adapters/speed/retry.py). The engine loads while other work may share the GPU and measures with the GPU alone
(tasks/runtime/launch.measuring).

A fresh process per engine start means engines never share a CUDA context or allocator state, and a
crash, an out-of-memory kill or a hang costs that run's results ("failed", with a one-line reason), not
the flow. Scenarios that need the same engine options may share one process (one engine start). The session's rows
are assembled from what its process measured in tasks/steps/session_rows.py.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

from quantgate.catalog.errors import one_line
from quantgate.catalog.records import SpeedResult
from quantgate.catalog.scenarios import OfflineScenario, ScenarioSpec
from quantgate.tasks.adapters import engines
from quantgate.tasks.adapters.engines import Engine, EngineOptions, RequestTiming, cuda_available
from quantgate.tasks.adapters.speed.checkpoint import is_compressed_tensors
from quantgate.tasks.adapters.speed.errors import BenchmarkError
from quantgate.tasks.adapters.speed.options import (
    engine_fit, engine_options, resolve_device, sized_kv_cache, start_memory_bytes, wants_random_weights,
)
from quantgate.tasks.adapters.speed.prompts import Prompts, make_prompt_sets
from quantgate.tasks.adapters.speed.retry import Failure, fallback_options, retry_on_oom
from quantgate.tasks.runtime import faults, launch
from quantgate.tasks.runtime.environment import library_versions
from quantgate.tasks.runtime.telemetry import PassClocks, Telemetry, device_name, measure_bandwidth_gbps
from quantgate.tasks.steps.session_rows import measured_alone, measured_row, same_rows, start_details


def engine_sessions(
    model_path: str, scenarios: Sequence[tuple[str, ScenarioSpec]], options: Mapping[str, Any] | None = None
) -> list[list[tuple[str, ScenarioSpec]]]:
    """(name, scenario) pairs grouped so that each group needs one engine start: same device, same engine
    options. Groups keep the order of their first scenario; a group's scenarios keep theirs. The GPU suite's
    steps are such groups, written out (flows/gpu_suite.check_steps holds them to it)."""
    # Options hold dicts (a speculative config): compared, not hashed.
    keys: list[tuple[str, EngineOptions]] = []
    groups: list[list[tuple[str, ScenarioSpec]]] = []
    for name, scenario in scenarios:
        device = resolve_device(scenario.device)
        key = (device, engine_options(scenario, device, options, dummy_weights=wants_random_weights(model_path, scenario)))
        if key in keys:
            groups[keys.index(key)].append((name, scenario))
        else:
            keys.append(key)
            groups.append([(name, scenario)])
    return groups


def run_scenario(
    model_path: str,
    engine_name: str,
    scenario_name: str,
    scenario: ScenarioSpec,
    *,
    isolate: bool = True,
    timeout_s: float = 3600.0,
    options: Mapping[str, Any] | None = None,
) -> SpeedResult:
    """Measure one engine on one scenario. Never raises for engine trouble: the result says skipped or failed.

    `options` overrides EngineOptions fields (e.g. gpu_memory_utilization, enforce_eager).
    isolate=False runs in this process (debugging only: no timeout, and memory readings include the caller).
    """
    return run_scenarios(
        model_path, engine_name, [(scenario_name, scenario)], isolate=isolate, timeout_s=timeout_s, options=options
    )[0]


def run_scenarios(
    model_path: str,
    engine_name: str,
    scenarios: Sequence[tuple[str, ScenarioSpec]],
    *,
    isolate: bool = True,
    timeout_s: float = 3600.0,
    options: Mapping[str, Any] | None = None,
    log_dir: str | Path | None = None,
    pair_with: str | None = None,
) -> list[SpeedResult]:
    """Measure one engine on several (name, scenario) pairs after one engine start, in one process.

    The scenarios must need the same engine options (BenchmarkError otherwise). If the engine start
    runs out of GPU memory, vLLM is tried again with less (fallback_options); the results' config
    records the options finally used and details["attempts"] the failed tries. A failure of one
    scenario after the start fails that scenario alone. With `log_dir`, the engine process's output
    (vLLM's engine core's too) goes to a file there per attempt, and a failure's reason names the
    root cause found in it.

    With `pair_with` (the base checkpoint of a variant), the same engine loads it too, first, and the passes of
    each `paired` scenario alternate between the two (`_measure_one`); the variant's rows carry the base's passes
    as details["paired_base"]. A base that does not load, a base folder that is not there, two engines that do not
    fit the GPU together, or an isolated retry after running out of memory (it starts alone) leaves the variant's
    passes alone, saying why (details["unpaired"]). An engine sized larger than the GPU fails before it starts.
    """
    if not scenarios:
        return []
    device, opts = _session_options(model_path, scenarios, options)
    if (refused := _refusal(model_path, engine_name, device)) is not None:
        return same_rows(engine_name, scenarios, *refused, opts)
    what = engines.kind(engine_name)
    if what.decompresses_quantized and is_compressed_tensors(model_path):
        if decompressed := [item for item in scenarios if not item[1].transformers_decompressed]:
            asked = [item for item in scenarios if item not in decompressed]
            return same_rows(engine_name, decompressed, "skipped", DECOMPRESSED, opts) + run_scenarios(
                model_path, engine_name, asked, isolate=isolate, timeout_s=timeout_s, options=options,
                log_dir=log_dir, pair_with=pair_with)
    items = [s for _, s in scenarios]
    if what.reserves_gpu_share:
        opts = sized_kv_cache(opts, model_path, items)
    pair = _pairing(pair_with, engine_name, device, scenarios, options)
    need, too_big, unpaired = engine_fit(opts, model_path, engine_name, pair)
    if too_big:
        return same_rows(engine_name, scenarios, "failed", too_big, opts)  # before it starts
    pair = None if unpaired else pair
    start = _EngineStart(model_path, engine_name, items, pair, need, isolate, timeout_s,
                         Path(log_dir) if log_dir and isolate else None)
    needed_len = max(s.input_len + s.output_len for s in items)
    tried = retry_on_oom(fallback_options(opts, engine_name, needed_len), start.deadline, start)
    details = start_details(tried, what.logs_compile_cache, start.log_dir, engine_name, isolate)
    if tried.value is None:
        return same_rows(engine_name, scenarios, "failed", tried.error, tried.used, details)
    alone = unpaired or measured_alone(pair_with, pair, tried.attempts, isolate)
    out = [measured_row(model_path, engine_name, name, scenario, tried.used, one, details, alone)
           for (name, scenario), one in zip(scenarios, tried.value, strict=True)]
    faults.point("benchmark")
    return out


# Why Transformers does not time a compressed-tensors checkpoint unless the scenario asks.
DECOMPRESSED = ("Transformers decompresses this compressed-tensors checkpoint to 16 bits as it loads it: it would"
                " time the base's kernels again (transformers_decompressed: true in the scenario measures it)")


def _session_options(model_path: str, scenarios: Sequence[tuple[str, ScenarioSpec]],
                     options: Mapping[str, Any] | None) -> tuple[str, EngineOptions]:
    """The device and engine options the scenarios share (one engine start), or BenchmarkError."""
    if serving := [name for name, s in scenarios if s.kind == "serving"]:
        raise BenchmarkError(f"{serving[0]!r} is a serving scenario: run it with tasks.speed.serving.serve_scenario")
    first_name, first = scenarios[0]
    device = resolve_device(first.device)
    dummy = wants_random_weights(model_path, first)
    opts = engine_options(first, device, options, dummy_weights=dummy)
    for name, scenario in scenarios[1:]:
        same = engine_options(scenario, device, options, dummy_weights=dummy) == opts
        if resolve_device(scenario.device) != device or not same:
            raise BenchmarkError(
                f"scenarios {first_name!r} and {name!r} need different engine options; run them in separate processes"
            )
    return device, opts


def _refusal(model_path: str, engine_name: str, device: str) -> tuple[Literal["skipped", "failed"], str] | None:
    """Why the engine does not start here at all: not available on this device, no model folder, a load-time
    variant it cannot load."""
    if (why := engines.availability(engine_name, device)) is not None:
        return "skipped", why
    if not Path(model_path).is_dir():
        return "failed", f"no model folder at {model_path}"
    if (why := _load_time_problem(model_path, engine_name, device)) is not None:
        return "skipped", why
    return None


@dataclasses.dataclass
class _EngineStart:
    """One start of the session's engine, as the out-of-memory retry calls it (retry_on_oom): in a process group of
    its own (isolated), which shares the GPU until it measures (tasks/runtime/launch.in_process_group); a retry
    starts with the GPU alone, nothing else loading beside it, and is not admitted by memory."""

    model_path: str
    engine_name: str
    items: list[ScenarioSpec]
    pair: tuple[str, EngineOptions] | None
    need: int
    isolate: bool
    timeout_s: float
    log_dir: Path | None
    deadline: launch.Deadline = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.deadline = launch.Deadline(self.timeout_s)

    def __call__(self, used: EngineOptions, tried: int) -> list[tuple[str, Any]] | Failure:
        log = self.log_dir / f"{self.engine_name}-{tried}.log" if self.log_dir else None
        if not self.isolate:
            try:
                return _measure_group(self.model_path, self.engine_name, self.items, used, self.pair)
            except Exception as e:
                return Failure(one_line(e), None)
        paired = self.pair if not tried else None
        memory = self.need + (start_memory_bytes(self.pair[1], self.pair[0], self.engine_name) if self.pair else 0)
        slot = launch.Slot.for_try(f"{self.engine_name}'s engine on {Path(self.model_path).name}", memory, tried)
        status, payload = launch.in_process_group(
            _measure_group, (self.model_path, self.engine_name, self.items, used, paired),
            self.deadline.left() if tried else self.timeout_s, log, name=f"quantgate-bench-{self.engine_name}",
            slot=slot,
        )
        return payload if status == "ok" else Failure(payload, log)


def _pairing(pair_with: str | None, engine_name: str, device: str, scenarios: Sequence[tuple[str, ScenarioSpec]],
             options: Mapping[str, Any] | None) -> tuple[str, EngineOptions] | None:
    """The base checkpoint and the options its engine loads with beside a variant's (those of the base's own
    session of these scenarios), or None when no scenario is paired or there is nothing to pair with."""
    paired = [s for _, s in scenarios if getattr(s, "paired", False)]
    if not pair_with or not paired or not Path(pair_with).is_dir():
        return None
    opts = engine_options(paired[0], device, options, dummy_weights=wants_random_weights(pair_with, paired[0]))
    if engines.kind(engine_name).reserves_gpu_share:
        opts = sized_kv_cache(opts, pair_with, [s for _, s in scenarios])
    return pair_with, opts


def _load_time_problem(model_path: str, engine_name: str, device: str) -> str | None:
    """Why a load-time (bitsandbytes) variant cannot run on this engine and device, or None (also for
    ordinary checkpoints)."""
    from quantgate.tasks.adapters import loadtime

    if loadtime.descriptor(model_path) is None:
        return None
    if engines.kind(engine_name).bitsandbytes_loader == "engine":
        return loadtime.vllm_problem(model_path)
    return loadtime.unavailable(device)


def speed_environment() -> dict[str, Any]:
    """What speed depends on besides the checkpoint and the scenario: the libraries that run it, and the
    device: every visible GPU's name and the driver (NVML), or the CPU."""
    import platform

    if cuda_available():
        import torch

        versions = _versions("vllm", "cuda")
        gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        try:
            import pynvml

            pynvml.nvmlInit()
            driver = pynvml.nvmlSystemGetDriverVersion()
        except Exception:  # noqa: BLE001 - no NVML: the GPU names and CUDA version still say what ran
            driver = None
        return {"versions": versions, "gpus": gpus, "driver": driver}
    versions = _versions("vllm", "cpu")
    return {"versions": versions, "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()}


def _measure_group(
    model_path: str, engine_name: str, scenarios: list[ScenarioSpec], opts: EngineOptions,
    pair: tuple[str, EngineOptions] | None = None,
) -> list[tuple[str, Any]]:
    """Load the engine once and measure each scenario: ("ok", measurements) or ("failed", reason) each.
    An exception here (the variant's load) fails them all. With `pair`, the base loads first, beside it, and
    each paired scenario's passes alternate between the two (`_measure_one`)."""
    faults.point("measure")  # in the engine's own process when isolated: where an interrupt test holds it
    prompt_sets = [make_prompt_sets(s, model_path, s.warmup + s.repetitions) for s in scenarios]
    engine = engines.create(engine_name)
    base: Engine | None = None
    unpaired: str | None = None
    out: list[tuple[str, Any]] = []
    # GPU memory of this process group (the engine and vLLM's engine core): other jobs may share the GPU.
    with Telemetry(opts.device, group=os.getpgrp()) as telemetry:
        if pair is not None:
            base, unpaired = _load_base(engine_name, *pair)
            telemetry.rebase()  # the base's memory is not the variant's
        engine.load(model_path, opts)
        # Loaded: no NVML polling while it waits for the GPU or measures (Telemetry.still says why).
        with telemetry.still(), launch.measuring() as window:
            faults.point("measure:loaded", model_path)  # where a GPU fault test kills the engine or the run
            try:
                for scenario, sets in zip(scenarios, prompt_sets, strict=True):
                    began = datetime.now(timezone.utc)
                    paired = getattr(scenario, "paired", False)
                    try:
                        measured = _measure_one(engine, scenario, sets, telemetry, opts, base if paired else None)
                        measured["details"].update(window.details(began))
                        if paired and unpaired:
                            measured["details"]["unpaired"] = unpaired
                        out.append(("ok", measured))
                    except Exception as e:
                        out.append(("failed", one_line(e)))
            finally:
                engine.close()
                if base is not None:
                    base.close()
            # Measured last, on a GPU the engine has let go of: the ceiling the latency runs are held against.
            if opts.device == "cuda" and any(s.kind == "latency" for s in scenarios):
                _add_bandwidth(scenarios, out)
    return out


def _load_base(engine_name: str, base_path: str, opts: EngineOptions) -> tuple[Engine | None, str | None]:
    """The base's engine, loaded to alternate with a variant's, or why it did not load."""
    base = engines.create(engine_name)
    try:
        base.load(base_path, opts)
    except Exception as e:  # the variant is still measured, alone
        base.close()
        return None, f"the base did not load beside it: {one_line(e)}"
    return base, None


def _add_bandwidth(scenarios: list[ScenarioSpec], out: list[tuple[str, Any]]) -> None:
    bandwidth, problem = None, None
    try:
        bandwidth = measure_bandwidth_gbps()
    except Exception as e:  # the latency results stand without their roofline
        problem = one_line(e)
    for scenario, (status, measured) in zip(scenarios, out, strict=True):
        if status == "ok" and scenario.kind == "latency":
            measured["bandwidth_gbps"] = bandwidth
            if problem:
                measured["details"]["bandwidth"] = problem


def _measure_one(
    engine: Engine, scenario: ScenarioSpec, prompt_sets: list[Prompts], telemetry: Telemetry, opts: EngineOptions,
    base: Engine | None = None,
) -> dict[str, Any]:
    """The scenario's passes on `engine`; with `base`, each pass beside one of the base's on the same prompts, in
    the order base, variant, variant, base, ... so that a drift of the host that is linear in time cancels over
    two pairs, and the ratio of a pair holds what the host did in those seconds alone."""
    telemetry.reset_peaks()
    before = engine.stats()
    for prompts in prompt_sets[: scenario.warmup]:
        _workload(engine, prompts, scenario)
        if base is not None:
            _workload(base, prompts, scenario)
    mid = engine.stats()
    reps: list[dict[str, Any]] = []
    base_reps: list[dict[str, Any]] = []
    for i, prompts in enumerate(prompt_sets[scenario.warmup :]):
        if base is not None and i % 2 == 0:
            base_reps.append(_repetition(base, prompts, scenario, telemetry))
        reps.append(_repetition(engine, prompts, scenario, telemetry))
        if base is not None and i % 2 == 1:
            base_reps.append(_repetition(base, prompts, scenario, telemetry))
    after = engine.stats()
    prompts = prompt_sets[0]
    per_token_j = [r["energy_j"] / r["output_tokens"] if r["energy_j"] is not None else None for r in reps]
    tpot_ms = _median([r["tpot_ms"] for r in reps])
    details: dict[str, Any] = {"paired_base": base_reps} if base is not None else {}
    if "spec_decode_draft_tokens" in after:
        # Over the measured repetitions only.
        drafted = after["spec_decode_draft_tokens"] - mid["spec_decode_draft_tokens"]
        accepted = after["spec_decode_accepted_tokens"] - mid["spec_decode_accepted_tokens"]
        details["spec_decode"] = {"draft_tokens": drafted, "accepted_tokens": accepted,
                                  "acceptance_rate": accepted / drafted if drafted else None}
    return {
        "device": device_name(opts.device),
        "num_requests": len(prompts),
        "input_tokens": _median([r["input_tokens"] for r in reps]),
        "output_tokens": _median([r["output_tokens"] for r in reps]),
        "tokens_per_s": _median([r["tokens_per_s"] for r in reps]),
        "total_tokens_per_s": _median([r["total_tokens_per_s"] for r in reps]),
        "requests_per_s": _median([r["requests_per_s"] for r in reps]),
        "ttft_ms": _median([r["ttft_ms"] for r in reps]),
        "tpot_ms": tpot_ms,
        "e2el_ms": _median([r["e2el_ms"] for r in reps]),
        # Batch 1 only: one sequence's decode speed is what the roofline bounds.
        "decode_tokens_per_s": 1000 / tpot_ms if scenario.kind == "latency" and tpot_ms else None,
        "peak_memory_bytes": telemetry.peak_memory_bytes,
        "nvml_peak_bytes": telemetry.nvml_peak_bytes,
        # 0 when this process's torch never allocated: vLLM's allocator lives in its engine-core process.
        "torch_peak_bytes": telemetry.torch_peak_bytes or None,
        "kv_cache_tokens": before.get("kv_cache_tokens"),
        "energy_j_per_token": _median(per_token_j),
        "repetitions": reps,
        "versions": _versions(engine.name, opts.device),
        "details": details,
    }


def _workload(engine: Engine, prompts: Prompts, scenario: ScenarioSpec) -> tuple[float, list[RequestTiming]]:
    """All prompts once: one at a time ("latency"), or ("offline") all in one call to an engine that
    schedules them itself (as `vllm bench throughput` does), else in static batches of batch_size.
    Each request is timed from the start of its own generate call."""
    if isinstance(scenario, OfflineScenario):
        size = len(prompts) if engine.continuous_batching else scenario.batch_size
    else:
        size = 1
    timings: list[RequestTiming] = []
    start = time.perf_counter()
    for i in range(0, len(prompts), size):
        generation = engine.generate(prompts[i : i + size], scenario.output_len, sampling=scenario.sampling)
        got = generation.output_tokens
        if any(n != scenario.output_len for n in got):
            raise BenchmarkError(f"{engine.name} generated {got} tokens per sequence, expected {scenario.output_len}")
        timings += generation.requests
    return time.perf_counter() - start, timings


def _repetition(
    engine: Engine, prompts: Prompts, scenario: ScenarioSpec, telemetry: Telemetry
) -> dict[str, Any]:
    before = telemetry.energy_mj()
    began_at = time.time()
    with PassClocks() as clocks:
        wall, timings = _workload(engine, prompts, scenario)
    after = telemetry.energy_mj()
    out = sum(t.output_tokens for t in timings)
    prompt_tokens = sum(t.prompt_tokens for t in timings)
    # A counter that did not move over a very short run says nothing, so it is not reported as 0 J.
    energy_j = (after - before) / 1000 if before is not None and after is not None and after > before else None
    return {
        "began_at": began_at,  # UNIX time: the order of a paired session's passes
        "wall_s": wall,
        "input_tokens": prompt_tokens,
        "output_tokens": out,
        "tokens_per_s": out / wall,
        "total_tokens_per_s": (prompt_tokens + out) / wall,
        "requests_per_s": len(timings) / wall,
        "ttft_ms": _ms(_median([t.ttft_s for t in timings])),
        "tpot_ms": _ms(_median([t.tpot_s for t in timings])),
        "e2el_ms": _ms(_median([t.e2el_s for t in timings])),
        "energy_j": energy_j,
        # Where the time of a CPU-bound pass went (telemetry.PassClocks), and the GPU's clock as it ended.
        **clocks.figures(),
        "sm_clock_mhz": telemetry.sm_clock_mhz(),
    }


def _median(values: list[Any]) -> Any:
    if not values or any(v is None for v in values):
        return None
    return statistics.median(values)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


def _versions(engine_name: str, device: str) -> dict[str, str]:
    """The libraries an engine's measurement ran on (its own package too), and CUDA's version on a GPU."""
    package = engines.kind(engine_name).package
    versions = library_versions(["torch", "transformers", "compressed-tensors"] + ([package] if package else []))
    if device == "cuda":
        import torch

        versions["cuda"] = str(torch.version.cuda)
    return versions


def measure_session(model_path: str, engine: str, scenarios: Sequence[tuple[str, ScenarioSpec]], *,
                    work_dir: Path, timeout_s: float | None, pair_with: str | None,
                    on_point: Callable[[SpeedResult, list[Any]], None] | None) -> list[tuple[SpeedResult, list[Any]]]:
    """The engine-session backend of tasks/steps/measure.py: `run_scenarios` with its logs under `work_dir`."""
    results = run_scenarios(model_path, engine, scenarios, timeout_s=timeout_s or 3600.0, log_dir=work_dir,
                            pair_with=pair_with)
    for r in results:
        if on_point:
            on_point(r, [])
    return [(r, []) for r in results]
