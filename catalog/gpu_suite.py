"""The GPU suite (catalog/gpu.yaml): dummy-weight shapes and builds, its scenarios, and its steps."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, ValidationError, model_validator

from quantgate.catalog.errors import CatalogError
from quantgate.catalog.scenarios import ScenarioSpec, ServingScenario, bench_mismatch
from quantgate.catalog.spec import Strict, read_mapping, validation_line


class ShapeSpec(Strict):
    """A model shape for dummy-weight speed runs: a preset config (tasks/dummy_weights.SHAPES) plus overrides."""

    preset: str
    overrides: dict[str, int | float | str | bool | list[int] | None] = {}


class BuildSpec(Strict):
    """A dummy checkpoint of the shape: BF16 (no weight files: engines initialise randomly) or W4A16
    (random packed weights written, since vLLM's dummy loader leaves int32 packed weights uninitialised)."""

    quant: Literal["w4a16"] | None = None
    group_size: int = Field(default=128, ge=8)


class SuiteStep(Strict):
    """One isolated unit of the GPU suite: an engine process running its scenarios, a `vllm bench
    throughput` cross-check (vllm-bench) or a `vllm serve` server driven through its loads (vllm-serve)."""

    part: str = Field(pattern=r"^[a-z0-9][a-z0-9_-]*$")
    engine: Literal["transformers", "vllm", "vllm-bench", "vllm-serve"]
    build: str
    scenarios: tuple[str, ...] = Field(min_length=1)
    timeout_s: float = Field(default=300, gt=0)

    @property
    def engine_session(self) -> bool:
        """Whether the step loads an engine once for its scenarios (not a bench or a server, one per scenario)."""
        return self.engine in ("transformers", "vllm")

    @property
    def engine_started(self) -> str:
        """The engine the step starts, which must be available where it runs: the bench's and the server's is vLLM."""
        return "transformers" if self.engine == "transformers" else "vllm"

    @property
    def rows_engine(self) -> str:
        """The engine its rows name: a server's rows are vLLM's serving rows, as in evaluate-model's."""
        return "vllm" if self.engine == "vllm-serve" else self.engine

    @property
    def on_gpu(self) -> bool:
        """Whether it runs on the GPU whatever its scenarios say: `vllm bench` and `vllm serve` do."""
        return not self.engine_session


class GpuSuiteSpec(Strict):
    """catalog/gpu.yaml: dummy-weight shapes and builds, scenarios, and the steps in priority order."""

    version: Literal[1]
    shapes: dict[str, ShapeSpec]
    builds: dict[str, BuildSpec]
    base_build: str
    scenarios: dict[str, ScenarioSpec]
    steps: tuple[SuiteStep, ...]
    # As the catalog's gpu_prices; None: the packaged catalog's (catalog/models.yaml).
    gpu_prices: dict[str, Annotated[float, Field(gt=0)]] | None = None

    @model_validator(mode="after")
    def _references_resolve(self) -> GpuSuiteSpec:
        if self.base_build not in self.builds:
            raise ValueError(f"base_build: unknown build {self.base_build!r}; defined: {sorted(self.builds)}")
        for i, step in enumerate(self.steps):
            if step.build not in self.builds:
                raise ValueError(f"steps.{i}.build: unknown build {step.build!r}; defined: {sorted(self.builds)}")
            for name in step.scenarios:
                if name not in self.scenarios:
                    raise ValueError(f"steps.{i}.scenarios: unknown scenario {name!r}; defined: {sorted(self.scenarios)}")
                s = self.scenarios[name]
                wanted = {"vllm-serve": ("serving",), "vllm-bench": ("offline",)}.get(step.engine, ("offline", "latency"))
                if s.kind not in wanted:
                    raise ValueError(
                        f"steps.{i}: engine {step.engine} runs {'/'.join(wanted)} scenarios, {name!r} is {s.kind}"
                    )
                engine = step.engine.removesuffix("-bench").removesuffix("-serve")
                if engine not in s.engines:
                    raise ValueError(f"steps.{i}: scenario {name!r} does not list engine {engine!r}")
            sweeps = [n for n in step.scenarios if isinstance(self.scenarios[n], ServingScenario) and self.scenarios[n].sweep]
            if sweeps and step.engine != "vllm-serve":
                raise ValueError(f"steps.{i}: a sweep scenario runs on engine vllm-serve")
            if step.engine in ("vllm-bench", "vllm-serve") and len(step.scenarios) != 1:
                raise ValueError(f"steps.{i}: a {step.engine} step takes exactly one scenario")
            if step.engine == "vllm-bench" and (why := bench_mismatch(self.scenarios[step.scenarios[0]])):
                raise ValueError(f"steps.{i}: {why}")
        return self


def load_gpu_suite(path: str | Path) -> GpuSuiteSpec:
    """Load and validate a GPU suite file (catalog/gpu.yaml); prompts_file paths resolve against its folder."""
    path = Path(path)
    raw = read_mapping(path, "GPU suite", "version, shapes, builds, scenarios, steps")
    try:
        suite = GpuSuiteSpec.model_validate(raw)
    except ValidationError as e:
        raise CatalogError(validation_line(path, e)) from None
    base = path.parent.resolve()
    scenarios = {
        name: s.model_copy(update={"prompts_file": str((base / s.prompts_file).resolve()) if s.prompts_file else None})
        for name, s in suite.scenarios.items()
    }
    return suite.model_copy(update={"scenarios": scenarios})
