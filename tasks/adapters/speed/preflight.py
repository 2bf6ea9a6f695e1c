"""What a run on a vLLM process (`vllm serve`, `vllm bench`) settles before it starts one: its engine options (the
KV cache sized to the scenario's load), the builder of its result rows, and the row when it cannot run at all."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from quantgate.catalog.records import SpeedResult
from quantgate.catalog.scenarios import ScenarioSpec
from quantgate.tasks.adapters import engines
from quantgate.tasks.adapters.engines import EngineOptions
from quantgate.tasks.adapters.speed.options import engine_options, sized_kv_cache, wants_random_weights


def preflight(
    engine: str, model_path: str, scenario_name: str, scenario: ScenarioSpec, options: dict[str, Any] | None
) -> tuple[EngineOptions, Callable[..., SpeedResult], SpeedResult | None]:
    """Options, a result builder for `engine`'s rows, and the skipped/failed row when it cannot run at all."""
    device = "cuda"
    opts = engine_options(scenario, device, options, dummy_weights=wants_random_weights(model_path, scenario))

    def result(status: str, reason: str | None, used: EngineOptions, **measured: Any) -> SpeedResult:
        config = {**scenario.model_dump(mode="json"), "engine_options": dataclasses.asdict(used)}
        return SpeedResult(engine, scenario_name, status, reason, config, **measured)  # type: ignore[arg-type]

    if (why := engines.availability("vllm", device)) is not None:
        return opts, result, result("skipped", why, opts)
    if not Path(model_path).is_dir():
        return opts, result, result("failed", f"no model folder at {model_path}", opts)
    from quantgate.tasks.adapters.loadtime import descriptor

    if descriptor(model_path) is not None:
        why = "a load-time (bitsandbytes) variant is measured by the offline engines only, not with vllm serve/bench"
        return opts, result, result("skipped", why, opts)
    # The KV cache an engine session of the same scenario gets (run_scenarios): the cross-check compares one config.
    return sized_kv_cache(opts, model_path, [scenario]), result, None

