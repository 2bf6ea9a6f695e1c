"""Engine registry. Engines are named by import path and imported on use, so vllm is only imported where it runs."""

from __future__ import annotations

import importlib
import importlib.util

from quantgate.catalog.settings import settings
from quantgate.tasks.adapters.engines.base import Engine, EngineError, EngineOptions, Generation, RequestTiming
from quantgate.tasks.runtime.telemetry import nvml_gpu_count

ENGINES: dict[str, str] = {
    "transformers": "quantgate.tasks.adapters.engines.transformers:TransformersEngine",
    "vllm": "quantgate.tasks.adapters.engines.vllm:VllmEngine",
}

__all__ = [
    "ENGINES", "Engine", "EngineError", "EngineOptions", "Generation", "RequestTiming", "availability", "create",
    "cuda_available",
]


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
    if engine == "vllm":
        if importlib.util.find_spec("vllm") is None:
            return "vllm is not installed (install the 'gpu' extra on a CUDA machine)"
        if device == "cpu":
            return "vllm runs on a CUDA GPU only; the scenario asks for cpu"
        if not cuda_available():
            return "vllm needs a CUDA GPU and none is visible"
    elif device == "cuda" and not cuda_available():
        return f"the scenario asks for cuda but no CUDA GPU is visible to {engine}"
    return None


def create(engine: str) -> Engine:
    if engine not in ENGINES:
        raise EngineError(f"unknown engine {engine!r}; known: {sorted(ENGINES)}")
    module, _, cls = ENGINES[engine].partition(":")
    return getattr(importlib.import_module(module), cls)()
