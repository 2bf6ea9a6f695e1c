"""What a speed scenario asks of an engine: the device, the engine options, random weights or the checkpoint's."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from quantgate.catalog.schema import ScenarioSpec
from quantgate.tasks.engines import EngineOptions
from quantgate.tasks.speed.errors import BenchmarkError


def resolve_device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


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

