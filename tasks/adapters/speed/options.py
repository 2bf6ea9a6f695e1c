"""What a speed scenario asks of an engine: the device, the engine options, random weights or the checkpoint's."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from quantgate.catalog.scenarios import ScenarioSpec
from quantgate.tasks.adapters import engines
from quantgate.tasks.adapters.engines import EngineOptions, cuda_available
from quantgate.tasks.adapters import model_memory
from quantgate.tasks.adapters.speed.checkpoint import text_config
from quantgate.tasks.adapters.speed.errors import BenchmarkError
from quantgate.tasks.runtime.telemetry import vllm_start_check_bytes
from quantgate.tasks.adapters.dummy_weights import DummyWeightsError
from quantgate.tasks.adapters.roofline import RooflineError, checkpoint_tensors, kv_bytes_per_token

# Room over the scenarios' whole load in the KV cache: vLLM allocates whole blocks, and CUDA-graph padding and the
# scheduler's look-ahead take a little more than the tokens themselves.
KV_HEADROOM = 1.25
MIN_KV_CACHE_BYTES = 1 << 30
# With a sized KV cache this only sets the free memory vLLM asks for at start, while other jobs hold the rest; what
# the engine takes is admitted beside them on its own count (start_memory_bytes), so the check asks little: a 1.5B
# model's engine with a small cache takes about 7 GB of an H200's 141.
SIZED_GPU_MEMORY_UTILIZATION = 0.05


def resolve_device(device: str) -> str:
    if device != "auto":
        return device
    return "cuda" if cuda_available() else "cpu"


def engine_options(
    scenario: ScenarioSpec,
    device: str,
    overrides: Mapping[str, Any] | None = None,
    *,
    dummy_weights: bool = False,
) -> EngineOptions:
    dtype = scenario.dtype if scenario.dtype != "auto" else ("bfloat16" if device == "cuda" else "float32")
    options = EngineOptions(
        device=device,  # type: ignore[arg-type]
        dtype=dtype,
        seed=scenario.seed,
        enable_prefix_caching=scenario.enable_prefix_caching,
        max_model_len=scenario.model_len,
        enforce_eager=scenario.enforce_eager,
        dummy_weights=dummy_weights,
        speculative_config=scenario.speculative.model_dump() if scenario.speculative else None,
        tensor_parallel_size=scenario.tensor_parallel_size,
        max_cudagraph_capture_size=scenario.max_cudagraph_capture_size,
        compile=scenario.transformers_compile,
    )
    if scenario.gpu_memory_utilization is not None:
        options = dataclasses.replace(options, gpu_memory_utilization=scenario.gpu_memory_utilization)
    known = [f.name for f in dataclasses.fields(EngineOptions)]
    if unknown := sorted(set(overrides or {}) - set(known)):
        raise BenchmarkError(f"unknown engine option(s) {unknown}; known: {known}")
    return dataclasses.replace(options, **(overrides or {}))


def wants_random_weights(model_path: str | Path, scenario: ScenarioSpec) -> bool:
    """A dummy-weights scenario on a folder without weight files: the engine initialises weights randomly.
    A dummy checkpoint that has weight files (W4A16: vLLM's dummy loader would leave its packed
    int32 weights uninitialised) loads them like any checkpoint."""
    return scenario.weights == "dummy" and not any(Path(model_path).glob("*.safetensors"))



def sized_kv_cache(opts: EngineOptions, model_path: str | Path, scenarios: Sequence[ScenarioSpec]) -> EngineOptions:
    """vLLM's options with a KV cache sized to what the scenarios hold at most (every sequence they may have in
    flight at full length, KV_HEADROOM over it, never less than one sequence of max_model_len) instead of a share
    of the GPU's memory. The figures are those of a larger cache, since this one never fills: nothing is preempted
    or queued for room (the serving sweep's moot rule reads the size). An engine that starts beside other work
    takes what it needs, not 80% of the GPU, and its size does not depend on what else the GPU holds.

    Unchanged off a GPU, when a scenario sets gpu_memory_utilization, or without a config to size from."""
    if opts.device != "cuda" or opts.kv_cache_memory_bytes or any(s.gpu_memory_utilization is not None
                                                                  for s in scenarios):
        return opts
    config = text_config(model_path)
    if not config or not scenarios:
        return opts
    tokens = max(max(s.most_in_flight() * (s.input_len + s.output_len) for s in scenarios), opts.max_model_len or 0)
    per_token = kv_bytes_per_token(config, 4 if opts.dtype == "float32" else 2)
    return dataclasses.replace(opts, kv_cache_memory_bytes=max(MIN_KV_CACHE_BYTES, int(tokens * per_token * KV_HEADROOM)),
                               gpu_memory_utilization=SIZED_GPU_MEMORY_UTILIZATION)


def start_memory_bytes(opts: EngineOptions, model_path: str | Path, engine_name: str) -> int:
    """The GPU memory an engine's start will take, for its admission beside other work (tasks/runtime/launch.GpuClock):
    its weights as stored (as its config lays them out, for a dummy-weight folder), its KV cache where sized, and
    the engine's overhead for the model's widths (model_memory.engine_overhead_bytes); for vLLM at least the share
    of the GPU it asks to find free at start (gpu_memory_utilization). 0 off a GPU."""
    if opts.device != "cuda":
        return 0
    try:  # a dummy-weight folder has no weight files: the layout its config implies
        weights = sum(nbytes for _, nbytes in checkpoint_tensors(model_path).values())
    except (RooflineError, DummyWeightsError, OSError, KeyError, ValueError):
        weights = 0  # no estimate: vLLM's own check (below) still holds
    overhead = model_memory.engine_overhead_bytes(text_config(model_path) or {})
    need = weights + (opts.kv_cache_memory_bytes or 0) + overhead
    checked = vllm_start_check_bytes(opts.gpu_memory_utilization) if engines.kind(engine_name).reserves_gpu_share else None
    if checked is not None:
        need = max(need, checked)
    return need


def engine_fit(opts: EngineOptions, model_path: str | Path, engine_name: str,
               pair: tuple[str | Path, EngineOptions] | None) -> tuple[int, str | None, str | None]:
    """The memory an engine's start takes (start_memory_bytes); why it cannot start (a sized engine larger than the
    GPU), in one line; why the base's engine, `pair`, cannot load beside it for paired passes (the two do not fit
    the GPU together: each is then timed in a process of its own, as an unpaired scenario is)."""
    gpu = model_memory.gpu_bytes() if opts.device == "cuda" else None
    need = start_memory_bytes(opts, model_path, engine_name)
    stage = model_memory.StageNeed(f"{engine_name}'s engine on {Path(model_path).name}", {"engine": need})
    too_big = stage.over(gpu) if opts.kv_cache_memory_bytes else None
    unpaired = model_memory.pair_problem(need, start_memory_bytes(pair[1], pair[0], engine_name), gpu) if pair else None
    return need, too_big, unpaired
