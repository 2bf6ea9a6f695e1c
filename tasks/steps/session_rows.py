"""The rows of an engine session (tasks/steps/benchmark.run_scenarios), assembled in the parent from what its engine
process measured: one row per scenario with its config (the scenario and the engine options used), what every row
shares of the session's starts, why a paired scenario ran without its base, and the figures the parent derives from
the checkpoint alone (KV-cache bytes, the roofline)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from quantgate.catalog.records import SpeedResult
from quantgate.catalog.scenarios import ScenarioSpec
from quantgate.tasks.adapters import engines
from quantgate.tasks.adapters.engines import EngineOptions
from quantgate.tasks.adapters.roofline import (
    RooflineError, checkpoint_tensors, decode_weight_bytes, dequantized_tensors, kv_bytes_per_token, roofline_fraction,
)
from quantgate.tasks.adapters.speed.checkpoint import text_config
from quantgate.tasks.adapters.speed.retry import Retried
from quantgate.tasks.adapters.speed.vllm_cli import compile_cache_from_log
from quantgate.tasks.runtime import launch


def same_rows(engine_name: str, scenarios: Sequence[tuple[str, ScenarioSpec]],
              status: Literal["ok", "skipped", "failed"], reason: str | None, used: EngineOptions,
              details: dict[str, Any] | None = None) -> list[SpeedResult]:
    """One row per scenario, all with the same status and reason."""
    return [SpeedResult(engine_name, name, status, reason, row_config(scenario, used), details=dict(details or {}))
            for name, scenario in scenarios]


def start_details(tried: Retried[list[tuple[str, Any]]], compile_log: bool, log_dir: Path | None, engine_name: str,
                  isolate: bool) -> dict[str, Any]:
    """What every row of the session shares of its starts: the one load, one more per out-of-memory retry, and the
    base's where it loaded beside the variant; the wait for memory, the failed tries, the compile cache used."""
    base_loaded = any(status == "ok" and "paired_base" in measured.get("details", {})
                      for status, measured in tried.value or [])
    details: dict[str, Any] = {"engine_starts": tried.engine_starts + base_loaded}
    if isolate and (waited := launch.memory_wait_s()):
        details["memory_wait_s"] = round(waited, 3)
    if tried.attempts:
        details["attempts"] = tried.attempts
    if compile_log and log_dir is not None:
        if compiled := compile_cache_from_log(log_dir / f"{engine_name}-{len(tried.attempts)}.log"):
            details["compile_cache"] = compiled
    return details


def measured_row(model_path: str, engine_name: str, name: str, scenario: ScenarioSpec, used: EngineOptions,
                 one: tuple[str, Any], details: dict[str, Any], alone: str | None) -> SpeedResult:
    """A scenario's row from what its engine process measured: failed with the reason, or its figures."""
    status, measured = one
    config = row_config(scenario, used)
    if status != "ok":
        return SpeedResult(engine_name, name, "failed", measured, config, details=dict(details))
    measured = {**measured, "details": {**details, **measured.get("details", {})}}
    if alone and getattr(scenario, "paired", False) and not {"paired_base", "unpaired"} & measured["details"].keys():
        measured["details"]["unpaired"] = alone
    return SpeedResult(engine_name, name, "ok", None, config,
                       **derived_figures(model_path, engine_name, used, measured))


def measured_alone(pair_with: str | None, pair: tuple[str, EngineOptions] | None, attempts: list, isolate: bool,
                   ) -> str | None:
    """Why a paired scenario's passes ran without the base, where its engine process could not know: there was no
    base folder, or the variant's process was a retry after running out of memory, which starts alone."""
    if not pair_with:
        return None
    if pair is None:
        return f"no base folder at {pair_with} to pair with"
    return "a retry after running out of GPU memory loads the variant alone" if attempts and isolate else None


def row_config(scenario: ScenarioSpec, used: EngineOptions) -> dict[str, Any]:
    """A row's config: the scenario, and the engine options it was measured with."""
    return {**scenario.model_dump(mode="json"), "engine_options": dataclasses.asdict(used)}


def derived_figures(model_path: str, engine_name: str, used: EngineOptions, measured: dict[str, Any]) -> dict[str, Any]:
    """What the parent adds to a child's measurement: KV-cache bytes and the roofline, which need only
    the checkpoint's config and headers."""
    out = dict(measured)
    config = text_config(model_path)
    if out.get("kv_cache_tokens") and config:
        dtype_bytes = 4 if used.dtype == "float32" else 2
        out["kv_cache_bytes"] = out["kv_cache_tokens"] * kv_bytes_per_token(config, dtype_bytes)
    from quantgate.tasks.adapters.loadtime import descriptor

    if out.get("decode_tokens_per_s") and out.get("bandwidth_gbps") and descriptor(model_path) is not None:
        # Its folder holds the base's config, whose layout would count 16-bit weights: not what is read.
        out["details"] = {**out.get("details", {}), "roofline": "not computed for a load-time (bitsandbytes) variant"}
    elif out.get("decode_tokens_per_s") and out.get("bandwidth_gbps"):
        # Transformers decompresses a quantized checkpoint on load and then reads 16-bit weights.
        dequantized = engines.kind(engine_name).decompresses_quantized and bool(config and config.get("quantization_config"))
        try:
            tensors = dequantized_tensors(model_path) if dequantized else checkpoint_tensors(model_path)
            weight_bytes = decode_weight_bytes(tensors)
        except (RooflineError, OSError, ValueError) as e:
            out["details"] = {**out.get("details", {}), "roofline": str(e)}
        else:
            out["weight_bytes_per_token"] = weight_bytes
            if dequantized:
                out["details"] = {**out.get("details", {}), "weights_read": "decompressed to 16 bits on load"}
            # Each of tensor_parallel_size GPUs streams its shard over its own memory.
            out["roofline_fraction"] = roofline_fraction(
                out["decode_tokens_per_s"], weight_bytes, out["bandwidth_gbps"] * used.tensor_parallel_size
            )
    return out
