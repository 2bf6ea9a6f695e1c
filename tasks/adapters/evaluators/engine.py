"""The vLLM engine of an evaluation (lm-eval's vllm backend), sized by the model (tasks/adapters/model_memory.py):
its max_model_len, its KV cache and the share of the GPU vLLM checks is free at its start."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from quantgate.tasks.adapters import model_memory
from quantgate.tasks.adapters.speed.checkpoint import text_config


def engine_plan(model_path: str | Path, words: Sequence[int] | None) -> model_memory.EvalEngine:
    """The engine an evaluation of `model_path` gets on this machine's GPU, for a suite whose tasks are sized in
    `words` (lm_eval.task_words); model_memory.CapacityError (one line) when it cannot fit, or cannot be sized."""
    config, tensors = text_config(model_path), model_memory.sized_tensors(model_path)
    if not config or tensors is None:
        raise model_memory.CapacityError(f"{model_path}: no config and weights to size its evaluation engine from")
    gpu = model_memory.gpu_bytes()
    max_len = model_memory.eval_max_model_len(config, words)
    engine = model_memory.eval_engine(model_memory.loaded_weight_bytes(tensors), config, max_len, gpu)
    if why := engine.need(f"the evaluation of {model_path}").over(gpu):
        raise model_memory.CapacityError(why)
    return engine


def shared_gpu_engine_args(engine: dict[str, Any]) -> dict[str, Any]:
    """vLLM options for an evaluation engine that shares its GPU with other unmeasured jobs: `engine` is
    model_memory.EvalEngine.args() (max_model_len, KV cache, the share of the GPU the engine takes).

    Quality and speed of a checkpoint do not share one engine start: lm-eval 0.4.13's vLLM backend cannot
    take an engine already loaded (`VLLM.__init__` always builds `LLM(**model_args)` from a path, unlike its
    hf backend, which takes a model object), and an evaluation may share a GPU with builds and other
    evaluations while a speed measurement must run alone; so evaluations run side by side, then speed.
    Scoring speed is not measured here: no torch.compile or CUDA-graph capture (a minute per start). A sized
    KV cache skips vLLM's free-memory profiling, which fails when another process on the GPU frees memory
    meanwhile; the utilization, the engine's size over the GPU's, then only sets the free memory vLLM checks
    for at start. lm-eval's rolling windows (perplexity tasks) are max_model_len long."""
    from vllm.engine.arg_utils import EngineArgs

    args: dict[str, Any] = {"enforce_eager": True, **engine}
    if "kv_cache_memory_bytes" not in getattr(EngineArgs, "__dataclass_fields__", {}):
        # An older vLLM profiles: its share then holds the weights and the cache.
        args.pop("kv_cache_memory_bytes", None)
    return args
