"""Compile warm-ups: a vLLM start with a speed job's own engine configuration, made while unmeasured work still
shares the GPU, so that the measured start later finds its torch.compile artifacts in VLLM_CACHE_ROOT.

A cold vLLM start of a 1.5B checkpoint spends about half its minute compiling. vLLM's compile cache key leaves
the memory settings out (`gpu_memory_utilization` and `kv_cache_memory_bytes` are ignored factors of
vllm/config/cache.py's compute_hash), so a warm-up with a small fixed KV cache compiles exactly what the measured
engine, `vllm serve` or `vllm bench` will load, without profiling memory that other jobs are using. Nothing is
measured here: a warm-up that fails costs the measured start its cache, nothing else.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from quantgate.catalog.schema import ScenarioSpec
from quantgate.tasks import launch
from quantgate.tasks.engines import EngineOptions
from quantgate.tasks.errors import one_line
from quantgate.tasks.speed.checkpoint import has_weight_only_int_layers
from quantgate.tasks.speed.errors import ServingError
from quantgate.tasks.speed.options import engine_options, resolve_device, wants_random_weights
from quantgate.tasks.speed.sweep import point_applies, sweep_row_name
from quantgate.tasks.speed.vllm_cli import sweep_settings

# Room for a few full-length sequences: a warm-up runs no load, and shares the GPU with builds and evaluations.
WARMUP_KV_CACHE_BYTES = 2 * 2**30
# With a fixed KV cache this only sets the free memory vLLM asks for at start: a small share, as other jobs hold
# the rest of the GPU meanwhile.
WARMUP_GPU_MEMORY_UTILIZATION = 0.1
WARMUP_TIMEOUT_S = 900.0
WARMUP_NICENESS = 10


@dataclass(frozen=True)
class WarmUp:
    """One engine start to warm: the offline engine of a session, `vllm bench throughput`, or `vllm serve` with a
    sweep point's flags and environment."""

    kind: Literal["offline", "bench", "serve"]
    options: EngineOptions
    serve_args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    label: str = ""


def warm_ups(model_path: str, engine: str, scenarios: Sequence[tuple[str, ScenarioSpec]]) -> list[WarmUp]:
    """The vLLM starts a speed job of `engine` on `scenarios` will make that a warm-up can prepare: its engine
    session, its bench, or its serving sweep's first point and the kernel points that run on this checkpoint.
    Points the defaults' measurement may show moot (an FP8 KV cache, a lower max_num_seqs) are not warmed: most
    never start. None for Transformers, or on a CPU."""
    if engine not in ("vllm", "vllm-bench") or not scenarios:
        return []
    name, first = scenarios[0]
    if resolve_device(first.device) != "cuda":
        return []
    opts = _warm(engine_options(first, "cuda", dummy_weights=wants_random_weights(model_path, first)))
    if engine == "vllm-bench":
        return [WarmUp("bench", opts, label=f"vllm bench {name}")]
    if first.kind != "serving":
        return [WarmUp("offline", opts, label=f"vllm {'+'.join(n for n, _ in scenarios)}")]
    points = first.sweep.points() if first.sweep else [{}]
    weight_only = has_weight_only_int_layers(model_path)
    out = []
    for i, point in enumerate(points):
        if i and not ("kernel" in point and point_applies(point, weight_only)):
            continue
        overrides, args, env = sweep_settings(point)
        out.append(WarmUp("serve", dataclasses.replace(opts, **overrides), tuple(args), tuple(sorted(env.items())),
                          label=f"vllm serve {sweep_row_name(name, point)}"))
    return out


def warm_up(model_path: str, warm: WarmUp, log_dir: Path) -> str | None:
    """Start and stop one engine as `warm` says; None when it started, else the one-line reason it did not."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"warmup-{warm.kind}-{_slug(warm.label)}.log"
    try:
        if warm.kind == "offline":
            status, payload = launch.in_process_group(_start_offline, (model_path, warm.options), WARMUP_TIMEOUT_S,
                                                      log, name="quantgate-warmup")
            return None if status == "ok" else payload
        if warm.kind == "bench":
            from quantgate.tasks.speed.bench import vllm_bench_throughput
            from quantgate.tasks.speed.vllm_cli import bench_engine_args

            vllm_bench_throughput(model_path, input_len=16, output_len=16, num_prompts=1, work_dir=log_dir / "bench",
                                  seed=warm.options.seed, extra_args=bench_engine_args(warm.options, 0),
                                  timeout_s=WARMUP_TIMEOUT_S)
            return None
        from quantgate.tasks.speed.server import free_port, start_server
        from quantgate.tasks.speed.vllm_cli import serve_engine_args

        with start_server(model_path, port=free_port(), extra_args=serve_engine_args(warm.options, warm.serve_args),
                          env=dict(warm.env), log_path=log, ready_timeout_s=WARMUP_TIMEOUT_S):
            return None
    except (ServingError, OSError) as e:
        return one_line(e)


def warm_up_aside(model_path: str, warm: WarmUp, log_dir: Path) -> str | None:
    """warm_up at a lower CPU priority, in a process of its own (launch.on_gpus): its engine and compile workers
    inherit it, so the builds and evaluations beside it, which the run waits for, get the CPU first."""
    os.nice(WARMUP_NICENESS)
    return warm_up(model_path, warm, log_dir)


def _warm(opts: EngineOptions) -> EngineOptions:
    return dataclasses.replace(opts, kv_cache_memory_bytes=WARMUP_KV_CACHE_BYTES,
                               gpu_memory_utilization=WARMUP_GPU_MEMORY_UTILIZATION)


def _start_offline(model_path: str, opts: EngineOptions) -> dict[str, Any]:
    from quantgate.tasks import engines

    engine = engines.create("vllm")
    engine.load(model_path, opts)
    engine.close()
    return {}


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_.@" else "-" for c in text)[:80]
