"""One entry for every speed measurement, backend × scenario: the backend is chosen by the engine a scenario runs on
and the scenario's kind, from a registry of "module:function" paths imported on use (so vLLM's command line is
imported only where it runs). evaluate-model's speed jobs (flows/dispatch.py), the GPU suite's steps
(flows/gpu_suite.py) and bench-endpoint (flows/bench_endpoint.py) all measure through `measure`; a new engine is a
module with a function of the `Backend` signature and a line in BACKENDS. Process isolation, retries after running out of memory and GPU placement stay
with the launcher (tasks/runtime/launch.py) that each backend starts its processes through.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from prefect import task
from prefect.cache_policies import NO_CACHE

from quantgate.catalog.records import ServingLoad, SpeedResult
from quantgate.catalog.scenarios import ScenarioSpec
from quantgate.tasks.adapters.speed.errors import BenchmarkError

if TYPE_CHECKING:
    from quantgate.tasks.adapters.endpoint import Target

# A speed row and, for a serving run, the loads it was measured at.
Measured = tuple[SpeedResult, list[ServingLoad]]
OnPoint = Callable[[SpeedResult, list[ServingLoad]], None]


class Backend(Protocol):
    def __call__(self, source: str | Target, engine: str, scenarios: Sequence[tuple[str, ScenarioSpec]], *,
                 work_dir: Path, timeout_s: float | None, pair_with: str | None,
                 on_point: OnPoint | None) -> list[Measured]:
        """The scenarios on `source` (a checkpoint folder's path; for the endpoint backend, the server to reach),
        each row handed to `on_point` as soon as it is in;
        `timeout_s` None: the backend's own limit; `pair_with`: a base whose passes a variant's alternate with, where
        the backend can (an engine session). Never raises for engine trouble: a row says skipped or failed."""
        ...


@dataclass(frozen=True)
class BackendKind:
    """A backend's function ("module:function", imported on use) and what it does, which its callers ask instead
    of its name: whether it groups several scenarios into one engine start (a session; otherwise each scenario is
    a start of its own); the job engines that always run on it, and the scenario kinds that bring a job of any
    engine to it; the scenario kinds it runs (None: any) and whether a job holds one scenario only, with the rule
    a job that breaks them is told."""

    path: str
    session: bool = False
    # The job engines measured by this backend whatever their scenarios (a scenario's `engines` entry, a GPU suite
    # step's engine), and the scenario kinds that bring a job of an engine nobody claims here.
    engines: frozenset[str] = frozenset()
    claims_kinds: frozenset[str] = frozenset()
    # What a job of this backend must be: its scenarios' kinds (None: any) and one scenario a job; else BenchmarkError
    # with `rule`.
    runs_kinds: frozenset[str] | None = None
    one_scenario: bool = False
    rule: str = ""


# An engine session: Transformers or vLLM loaded once in a process of its own for offline and latency scenarios
# (tasks/steps/benchmark.py); `vllm bench throughput`, the harness cross-check; `vllm serve` driven by a serving
# scenario's loads, once per point of its sweep; any OpenAI-compatible server reached by URL, driven by the same
# serving scenarios.
BACKENDS: dict[str, BackendKind] = {
    "session": BackendKind("quantgate.tasks.steps.benchmark:measure_session", session=True),
    "vllm-bench": BackendKind("quantgate.tasks.adapters.speed.bench:measure_bench", engines=frozenset({"vllm-bench"})),
    "vllm-serve": BackendKind("quantgate.tasks.adapters.speed.sweep:measure_serving", engines=frozenset({"vllm-serve"}),
                              claims_kinds=frozenset({"serving"}), runs_kinds=frozenset({"serving"}),
                              one_scenario=True, rule="a serving scenario is measured alone"),
    "endpoint": BackendKind("quantgate.tasks.adapters.endpoint:measure_endpoint", engines=frozenset({"endpoint"}),
                            runs_kinds=frozenset({"serving"}), rule="an endpoint runs serving scenarios only"),
}
# The backend of a job that no engine and no scenario kind claims.
DEFAULT_BACKEND = "session"


def backend_name(engine: str, scenarios: Sequence[tuple[str, ScenarioSpec]]) -> str:
    """The backend of one job: the one that claims its engine (`vllm-bench`, `vllm-serve`, `endpoint`), else the one
    that claims a kind of its scenarios (a serving scenario: the server), else an engine session; BenchmarkError for
    a job its backend does not run (BackendKind.runs_kinds, one_scenario)."""
    kinds = {s.kind for _, s in scenarios}
    name = next((n for n, b in BACKENDS.items() if engine in b.engines), None)
    if name is None:
        name = next((n for n, b in BACKENDS.items() if b.claims_kinds & kinds), DEFAULT_BACKEND)
    what = BACKENDS[name]
    if (what.runs_kinds is not None and kinds != what.runs_kinds) or (what.one_scenario and len(scenarios) != 1):
        raise BenchmarkError(f"{'+'.join(n for n, _ in scenarios)}: {what.rule}")
    return name


def backend_of(engine: str, scenarios: Sequence[tuple[str, ScenarioSpec]]) -> BackendKind:
    """What the backend of a job of `engine` on `scenarios` does (BackendKind)."""
    return BACKENDS[backend_name(engine, scenarios)]


def measure(source: str | Target, engine: str, scenarios: Sequence[tuple[str, ScenarioSpec]], *,
            work_dir: str | Path, timeout_s: float | None = None, pair_with: str | None = None,
            on_point: OnPoint | None = None) -> list[Measured]:
    """`scenarios` on `source` (a checkpoint folder, or an endpoint's Target) with `engine`, through its backend
    (`Backend` says how)."""
    module, _, name = backend_of(engine, scenarios).path.partition(":")
    backend: Backend = getattr(importlib.import_module(module), name)
    return backend(source, engine, scenarios, work_dir=Path(work_dir), timeout_s=timeout_s, pair_with=pair_with,
                   on_point=on_point)


measure_task = task(measure, name="measure", tags=["benchmark"], cache_policy=NO_CACHE)
