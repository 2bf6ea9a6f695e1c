"""The one module that knows vLLM's command line: the `vllm serve` and `vllm bench throughput` commands and
their engine flags, the environment a vLLM process gets (VLLM_DISABLED_KERNELS for a forced kernel), and the
log lines read back (out of memory, the root cause, the kernel picked, the KV-cache size, the throughput)."""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from quantgate.catalog.scenarios import MP_KERNELS
from quantgate.tasks.adapters.engines import EngineOptions
from quantgate.tasks.adapters.speed.errors import ServingError
from quantgate.tasks.runtime.environment import library_versions

# `python -m vllm.entrypoints.cli.main` is what the `vllm` console script runs, without relying on PATH.
VLLM_CLI = (sys.executable, "-m", "vllm.entrypoints.cli.main")
# `vllm bench throughput` goes through tasks/adapters/speed/bench_gate.py: vLLM's command line with its first pass held
# until the parent says go, so that its start can share the GPU and its passes have it alone.
BENCH_CLI = (sys.executable, "-m", "quantgate.tasks.adapters.speed.bench_gate")
# The device has no route to the hubs or to usage collection; fail fast instead of retrying.
QUIET_ENV = {"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}


def vllm_serve_command(
    model_path: str, *, host: str, port: int, served_model_name: str, extra_args: Sequence[str] = ()
) -> list[str]:
    return [
        *VLLM_CLI,
        "serve",
        str(model_path),
        "--host",
        host,
        "--port",
        str(port),
        "--served-model-name",
        served_model_name,
        # Request logging is off by default in 0.26 (--enable-log-requests turns it on); the access log
        # would add one line per request.
        "--disable-uvicorn-access-log",
        *extra_args,
    ]


def vllm_cli_args(opts: EngineOptions) -> list[str]:
    """Engine flags of `vllm serve` and `vllm bench throughput` for the options the offline engine
    takes, so that all three run the same engine configuration. (The seed is left to the caller.)"""
    args = [
        "--dtype", opts.dtype,
        "--gpu-memory-utilization", str(opts.gpu_memory_utilization),
        "--tensor-parallel-size", str(opts.tensor_parallel_size),
        # Explicit either way: the CLI's default turns prefix caching on.
        "--enable-prefix-caching" if opts.enable_prefix_caching else "--no-enable-prefix-caching",
    ]
    if opts.max_model_len:
        args += ["--max-model-len", str(opts.max_model_len)]
    if opts.enforce_eager:
        args.append("--enforce-eager")
    if opts.dummy_weights:
        args += ["--load-format", "dummy"]
    if opts.speculative_config:
        args += ["--speculative-config", json.dumps(opts.speculative_config, sort_keys=True)]
    if opts.max_cudagraph_capture_size:
        args += ["--max-cudagraph-capture-size", str(opts.max_cudagraph_capture_size)]
    if opts.trust_remote_code:
        args.append("--trust-remote-code")
    if opts.kv_cache_memory_bytes:
        args += ["--kv-cache-memory-bytes", str(opts.kv_cache_memory_bytes)]
    return args


def serve_engine_args(opts: EngineOptions, extra_args: Sequence[str] = ()) -> list[str]:
    """The engine flags of `vllm serve` for `opts`, its seed, then `extra_args` (a sweep point's flags)."""
    return [*vllm_cli_args(opts), "--seed", str(opts.seed), *extra_args]


def bench_engine_args(opts: EngineOptions) -> list[str]:
    """The engine flags of `vllm bench throughput` for `opts`, detokenizing off."""
    return [*vllm_cli_args(opts), "--disable-detokenize"]


def sweep_settings(point: dict[str, Any]) -> tuple[dict[str, Any], list[str], dict[str, str]]:
    """A sweep point as (engine option overrides, extra `vllm serve` flags, environment). A forced kernel
    disables every other mixed-precision kernel through VLLM_DISABLED_KERNELS."""
    options: dict[str, Any] = {}
    args: list[str] = []
    env: dict[str, str] = {}
    for key, value in sorted(point.items()):
        if key == "enforce_eager":
            options["enforce_eager"] = bool(value)
        elif key == "max_num_seqs":
            args += ["--max-num-seqs", str(int(value))]
        elif key == "kv_cache_dtype":
            args += ["--kv-cache-dtype", str(value)]
        elif key == "kernel":
            env["VLLM_DISABLED_KERNELS"] = ",".join(k for k in MP_KERNELS if k != value)
        else:
            raise ServingError(f"unknown sweep setting {key!r}")
    return options, args, env


# What vLLM 0.26 and torch say when the GPU memory does not fit the engine, its KV cache or
# max_model_len, or when another process on the GPU freed memory while vLLM profiled its own (never in a healthy
# start's log). Each is worth one more start, made with the GPU alone.
_OOM = re.compile(
    r"CUDA out of memory|OutOfMemoryError|No available memory for the cache blocks"
    r"|is less than desired GPU memory utilization|which is larger than the available KV cache memory"
    r"|Error in memory profiling",
)


# vLLM prefixes the lines of its engine-core process with "(EngineCore_DP0 pid=123) ".
_EXCEPTION_LINE = re.compile(
    r"^(?:\(\S+ pid=\d+\)\s+)?((?:[A-Za-z_][\w.]*\.)?[A-Z]\w*(?:Error|Exception): .+)$", re.MULTILINE
)


# Of those, the one that says nothing about the engine's size: another process freed memory while vLLM profiled.
_PROFILING_RACE = re.compile(r"Error in memory profiling")


def looks_like_oom(text: str | None) -> bool:
    return bool(text and _OOM.search(text))


def looks_like_profiling_race(text: str | None) -> bool:
    return bool(text and _PROFILING_RACE.search(text))


def root_cause(log_text: str) -> str | None:
    """The first exception line of a log: vLLM's engine core reports why it failed only there, and the
    front end then raises a generic "Engine core initialization failed"."""
    found = _EXCEPTION_LINE.search(log_text)
    return found.group(1).strip()[:300] if found else None


# vLLM logs the mixed-precision kernel it picked for a quantized linear layer ("Using MacheteLinearKernel
# for CompressedTensorsWNA16").
_KERNEL = re.compile(r"Using (\w+LinearKernel)\b")


def kernel_from_log(path: str | Path) -> str | None:
    """The mixed-precision linear kernels vLLM chose, in the order its log names them, joined by "+" (layers of one
    checkpoint may get different ones); None when it names none."""
    found = dict.fromkeys(_KERNEL.findall(read_log(Path(path))))
    return "+".join(found) or None


_KV_TOKENS = re.compile(r"GPU KV cache size: ([\d,]+) tokens")


def compile_cache_from_log(path: str | Path) -> str | None:
    """How an engine start got its torch.compile artifacts: "loaded" from the compile cache (an earlier start
    of the same configuration compiled them), "compiled" at start, or None (eager, or no log)."""
    text = read_log(path)
    if "Directly load AOT compilation" in text or "Directly load the compiled graph" in text:
        return "loaded"
    if "(compilation: " in text or "torch.compile takes" in text:
        return "compiled"
    return None


def kv_cache_tokens_from_log(path: str | Path) -> int | None:
    """The KV-cache budget vLLM logs once its engine core has sized the cache."""
    try:
        match = _KV_TOKENS.search(Path(path).read_text(errors="replace"))
    except OSError:
        return None
    return int(match.group(1).replace(",", "")) if match else None


_THROUGHPUT_LINE = re.compile(
    r"Throughput:\s*([\d.]+)\s*requests/s,\s*([\d.]+)\s*total tokens/s,\s*([\d.]+)\s*output tokens/s"
)


def output_tokens_per_s_from_log(text: str) -> float | None:
    """The output tokens/s of `vllm bench throughput`'s printed summary line (its JSON lacks them)."""
    match = _THROUGHPUT_LINE.search(text)
    return float(match.group(3)) if match else None


def bench_throughput_command(
    model_path: str,
    *,
    input_len: int,
    output_len: int,
    num_prompts: int,
    seed: int,
    output_json: Path,
    extra_args: Sequence[str] = (),
    cli: Sequence[str] = BENCH_CLI,
) -> list[str]:
    """`vllm bench throughput` on the random dataset at fixed lengths (EOS ignored), its numbers to `output_json`."""
    return [
        *cli,
        "bench",
        "throughput",
        "--model",
        str(model_path),
        "--dataset-name",
        "random",
        # The random dataset prefers its own --random-*-len (defaults 1024 / 128) over --input-len/--output-len.
        "--random-input-len",
        str(input_len),
        "--random-output-len",
        str(output_len),
        "--random-range-ratio",
        "0",
        "--num-prompts",
        str(num_prompts),
        "--seed",
        str(seed),
        "--output-json",
        str(output_json),
        *extra_args,
    ]


def read_log(path: str | Path) -> str:
    """A log's text; empty when it cannot be read."""
    try:
        return Path(path).read_text(errors="replace")
    except OSError:
        return ""


def vllm_versions() -> dict[str, str]:
    """The libraries a vLLM run's speed rows record, those installed."""
    return library_versions(("vllm", "torch", "transformers", "compressed-tensors"))

