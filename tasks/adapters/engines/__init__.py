"""Engine registry. Engines are named by import path and imported on use, so vllm is only imported where it runs."""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from typing import Literal

from quantgate.catalog.settings import settings
from quantgate.tasks.adapters.engines.base import Engine, EngineError, EngineOptions, Generation, RequestTiming
from quantgate.tasks.runtime.telemetry import nvml_gpu_count



@dataclass(frozen=True)
class EngineKind:
    """What an engine is and does, known without importing it: callers ask these, never the engine's name."""

    path: str  # "module:Class"
    # The distribution it needs beyond the CPU install, and whether it runs on a CUDA GPU only.
    package: str | None = None
    cuda_only: bool = False
    # It reserves a share of the GPU's memory at its start (gpu_memory_utilization), checks that share is free
    # first, and holds its KV cache in it, sized ahead (kv_cache_memory_bytes): a start that runs out of memory is
    # retried with a smaller share (tasks/adapters/speed/retry.py).
    reserves_gpu_share: bool = False
    # It loads a quantized checkpoint (a quantization_config: compressed-tensors, GPTQ) decompressed to 16 bits:
    # its speed is then the base's kernels', and the weights it reads are 16-bit.
    decompresses_quantized: bool = False
    # Its log names the torch.compile cache it used (vllm_cli.compile_cache_from_log).
    logs_compile_cache: bool = False
    # Who loads a load-time (bitsandbytes) variant: the engine's own loader, with its own limits, or bitsandbytes.
    bitsandbytes_loader: Literal["engine", "bitsandbytes"] = "bitsandbytes"


ENGINES: dict[str, EngineKind] = {
    "transformers": EngineKind("quantgate.tasks.adapters.engines.transformers:TransformersEngine",
                               decompresses_quantized=True),
    "vllm": EngineKind("quantgate.tasks.adapters.engines.vllm:VllmEngine", package="vllm", cuda_only=True,
                       reserves_gpu_share=True, logs_compile_cache=True, bitsandbytes_loader="engine"),
}

__all__ = [
    "ENGINES", "Engine", "EngineError", "EngineKind", "EngineOptions", "Generation", "RequestTiming", "availability",
    "create", "cuda_available", "kind",
]


def kind(engine: str) -> EngineKind:
    """What `engine` does (EngineKind); EngineError for an engine nobody registered."""
    if engine not in ENGINES:
        raise EngineError(f"unknown engine {engine!r}; known: {sorted(ENGINES)}")
    return ENGINES[engine]


def cuda_available() -> bool:
    """torch.cuda.is_available(), without importing torch (seconds) where NVML finds no GPU: a machine without
    the NVIDIA driver, which CUDA needs too, or one whose CUDA_VISIBLE_DEVICES hides every GPU."""
    if (settings().cuda_visible_devices or "unset").strip() in ("", "-1"):
        return False
    if nvml_gpu_count() == 0:
        return False
    import torch

    return torch.cuda.is_available()


def availability(engine: str, device: str) -> str | None:
    """Why `engine` cannot run on `device` ("cpu", "cuda" or "auto") here, or None when it can."""
    if engine not in ENGINES:
        return f"unknown engine {engine!r}; known: {sorted(ENGINES)}"
    what = ENGINES[engine]
    if what.package is not None and importlib.util.find_spec(what.package) is None:
        return f"{what.package} is not installed (install the 'gpu' extra on a CUDA machine)"
    if what.cuda_only:
        if device == "cpu":
            return f"{engine} runs on a CUDA GPU only; the scenario asks for cpu"
        if not cuda_available():
            return f"{engine} needs a CUDA GPU and none is visible"
    elif device == "cuda" and not cuda_available():
        return f"the scenario asks for cuda but no CUDA GPU is visible to {engine}"
    return None


def create(engine: str) -> Engine:
    module, _, cls = kind(engine).path.partition(":")
    return getattr(importlib.import_module(module), cls)()
