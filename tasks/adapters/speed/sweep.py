"""The serving sweep: vLLM's settings that matter for a variant, each point a normal serving run (vLLM's
defaults first), the tuned serving config being picked from their rows; points that cannot change the outcome
are skipped."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quantgate.catalog.records import ServingLoad, SpeedResult
from quantgate.catalog.scenarios import ScenarioSpec, ServingScenario, sweep_label
from quantgate.tasks.adapters.speed.checkpoint import has_weight_only_int_layers
from quantgate.tasks.adapters.speed.errors import ServingError
from quantgate.tasks.adapters.speed.serving import serve_scenario
from quantgate.tasks.adapters.speed.vllm_cli import sweep_settings
from quantgate.tasks.runtime import launch


def moot_point(point: dict[str, Any], scenario: ServingScenario, defaults: SpeedResult) -> str | None:
    """Why a sweep point cannot beat vLLM's defaults, as measured at the sweep's first point, or None.

    When the defaults' KV cache holds every request of the highest load at once, nothing is preempted or
    queued for cache room: an FP8 KV cache only adds room nobody needs, and a lower max_num_seqs can only
    queue requests the defaults ran at once, which lowers goodput unless the defaults missed the SLO somewhere
    (a smaller batch decodes each sequence faster). A cap at or above the highest concurrency changes nothing,
    and neither does forcing the kernel the defaults chose for every layer (their log names it).
    """
    if defaults.status != "ok":
        return None
    if "kernel" in point and set(point) == {"kernel"} and defaults.details.get("kernel") == point["kernel"]:
        return f"vLLM's defaults already ran every mixed-precision layer with {point['kernel']}"
    if not defaults.kv_cache_tokens:
        return None
    in_flight = scenario.most_in_flight()
    demand = in_flight * (scenario.input_len + scenario.output_len)
    kv_whole = defaults.kv_cache_tokens >= demand
    room = f"the defaults' KV cache ({defaults.kv_cache_tokens:,} tokens) held the highest load whole ({demand:,})"
    if "max_num_seqs" in point and int(point["max_num_seqs"]) >= in_flight:
        return f"max_num_seqs={point['max_num_seqs']} is at or above the most requests in flight ({in_flight})"
    if set(point) - {"kv_cache_dtype", "max_num_seqs"} or not kv_whole:
        return None
    if "max_num_seqs" in point:
        missed = [r["load"] for r in defaults.repetitions or []
                  if r.get("good_requests") is not None and r["good_requests"] < r["completed"]]
        if missed:
            return None
        return f"{room} and met the SLO at every load"
    return room


def point_applies(point: dict[str, Any], weight_only: bool | None) -> bool:
    """Whether a sweep point can change anything on a checkpoint whose weight-only integer layers are
    `weight_only` (tasks/adapters/speed/checkpoint.has_weight_only_int_layers; None: unknown): a forced kernel on one
    without mixed-precision layers would be the defaults served again, one more vLLM start."""
    return not ("kernel" in point and weight_only is False)


def sweep_row_name(scenario_name: str, point: dict[str, Any]) -> str:
    return f"{scenario_name}@{sweep_label(point)}"


Measured = tuple[SpeedResult, list[ServingLoad]]


@dataclass(frozen=True)
class _PointRun:
    """One point of a sweep as a serving run of its own (`serve`), in its own folder, with the point's settings."""

    serve: Callable[..., Measured]
    model_path: str
    scenario_name: str
    plain: ServingScenario  # the scenario without its sweep
    work_dir: Path
    options: dict[str, Any] | None

    def __call__(self, i: int, point: dict[str, Any], budget: float) -> Measured:
        overrides, args, env = sweep_settings(point)
        return self.serve(self.model_path, sweep_row_name(self.scenario_name, point), self.plain,
                          work_dir=self.work_dir / f"point{i:02d}", timeout_s=budget,
                          options={**(self.options or {}), **overrides}, extra_args=args, env=env)


def serve_sweep(
    model_path: str,
    scenario_name: str,
    scenario: ServingScenario,
    *,
    work_dir: str | Path,
    timeout_s: float = 900.0,
    options: dict[str, Any] | None = None,
    serve: Callable[..., tuple[SpeedResult, list[ServingLoad]]] | None = None,
    clock: Callable[[], float] = time.monotonic,
    on_point: Callable[[SpeedResult, list[ServingLoad]], None] | None = None,
    min_point_s: float = 60.0,
) -> list[tuple[SpeedResult, list[ServingLoad]]]:
    """Every point of the scenario's sweep as its own serving run (vLLM's defaults first), each named
    `<scenario>@<point>` with config.sweep = {scenario, point, settings, min_gain_pct}. Points the time does
    not reach, and forced kernels on a checkpoint that has no layer for them, get a skipped row, and so do points
    that cannot change the outcome on the defaults' figures (`moot_point`), except a forced kernel started beside
    the defaults (with a GPU clock), which is measured. `on_point` gets each point as soon as it is done, so that
    a sweep cut short keeps the points it finished."""
    if scenario.sweep is None:
        raise ServingError(f"scenario {scenario_name!r} has no sweep")
    points = scenario.sweep.points()
    plain = scenario.model_copy(update={"sweep": None})
    weight_only = has_weight_only_int_layers(model_path)
    runs = [point_applies(point, weight_only) for point in points]
    # The points' waits for the GPU (memory for each server's start, the GPU alone for its loads) are not the sweep's
    # time: the deadline moves by them.
    deadline = launch.Deadline(timeout_s, clock)
    run_point = _PointRun(serve or serve_scenario, model_path, scenario_name, plain, Path(work_dir), options)
    # Where engines start beside other work (a GPU clock), a forced kernel that applies starts with the defaults:
    # whether it runs depends on nothing they measure, so its start overlaps the unmeasured work instead of
    # holding up the measurements after it.
    ahead = {i: launch.beside(run_point, i, point, timeout_s) for i, point in enumerate(points)
             if i and runs[i] and set(point) == {"kernel"} and launch.starts_beside()}
    out: list[Measured] = []
    for i, point in enumerate(points):
        tag = {"scenario": scenario_name, "point": sweep_label(point), "settings": point,
               "min_gain_pct": scenario.sweep.min_gain_pct}
        if i in ahead:
            measured = _tagged(ahead[i].result(), tag)
        else:
            remaining = deadline.remaining()
            if skip := _skip_reason(point, runs[i], remaining, plain, out[0][0] if out else None):
                config = {**plain.model_dump(mode="json"), "sweep": tag}
                measured = (SpeedResult("vllm", sweep_row_name(scenario_name, point), "skipped", skip, config), [])
            else:
                budget = _point_budget(remaining, [r for j, r in enumerate(runs[i:], i) if j not in ahead], min_point_s)
                measured = _tagged(run_point(i, point, budget), tag)
        out.append(measured)
        if on_point:
            on_point(*measured)
    return out


def _point_budget(remaining: float, runs_left: list[bool], min_point_s: float) -> float:
    """The seconds a point may use of the `remaining`, with `runs_left` saying which points from it on still run in
    this thread: what is left beyond a minimum kept for each later one (the first start compiles and is the
    slowest), and never less than an even share."""
    left = sum(runs_left)
    return max(remaining / left, remaining - (left - 1) * min_point_s)


def _tagged(measured: Measured, tag: dict[str, Any]) -> Measured:
    """A point's row with config.sweep = `tag`."""
    result, loads = measured
    return dataclasses.replace(result, config={**result.config, "sweep": tag}), loads


def _skip_reason(point: dict[str, Any], applies: bool, remaining: float, plain: ServingScenario,
                 defaults: SpeedResult | None) -> str | None:
    """Why a point gets a skipped row: no time left (`remaining` seconds), no layer for its forced kernel on this
    checkpoint (`applies` False), or nothing it could change on the `defaults`' figures (moot_point); else None."""
    if remaining <= 1:
        return "sweep: the time was up before this point"
    if not applies:
        return (f"sweep: {sweep_label(point)} applies to weight-only quantized layers (W4A16-style);"
                " this checkpoint has none")
    if defaults is not None and (why := moot_point(point, plain, defaults)):
        return f"sweep: {sweep_label(point)} cannot change the outcome: {why}"
    return None


def serve_variant(
    model_path: str,
    scenario_name: str,
    scenario: ServingScenario,
    *,
    work_dir: str | Path,
    timeout_s: float = 1800.0,
    on_point: Callable[[SpeedResult, list[ServingLoad]], None] | None = None,
) -> list[tuple[SpeedResult, list[ServingLoad]]]:
    """A serving scenario on one checkpoint: one `vllm serve` run, or one per point of its sweep (the rows
    the tuned serving config is picked from). `on_point` gets each run as soon as it is done."""
    if scenario.sweep is not None:
        return serve_sweep(model_path, scenario_name, scenario, work_dir=work_dir, timeout_s=timeout_s,
                           on_point=on_point)
    run = serve_scenario(model_path, scenario_name, scenario, work_dir=work_dir, timeout_s=timeout_s)
    if on_point:
        on_point(*run)
    return [run]


def measure_serving(model_path: str, engine: str, scenarios: Sequence[tuple[str, ScenarioSpec]], *, work_dir: Path,
                    timeout_s: float | None, pair_with: str | None,
                    on_point: Callable[[SpeedResult, list[ServingLoad]], None] | None,
                    ) -> list[tuple[SpeedResult, list[ServingLoad]]]:
    """The `vllm-serve` backend of tasks/steps/measure.py: `serve_variant` on the one serving scenario; each server
    is its own window, so there is no base to pair with."""
    ((name, scenario),) = scenarios
    return serve_variant(model_path, name, scenario, work_dir=work_dir,  # type: ignore[arg-type]
                         on_point=on_point, **({"timeout_s": timeout_s} if timeout_s else {}))

