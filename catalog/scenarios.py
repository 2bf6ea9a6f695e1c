"""Benchmark scenarios (`scenarios:`): offline, latency and serving, each chosen by its `kind`."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, Tag, TypeAdapter, field_validator, model_validator

from quantgate.catalog.spec import Strict, kind_or


class SloSpec(Strict):
    """Service-level objective of a serving scenario: a request is good when it meets every limit given."""

    ttft_ms: float | None = Field(default=None, gt=0)
    tpot_ms: float | None = Field(default=None, gt=0)
    e2el_ms: float | None = Field(default=None, gt=0)
    # A load meets the SLO when at least this share of its requests is good (0.9: the p90 within every limit);
    # the cost at the SLO is priced at the fastest such load.
    attainment: float = Field(default=0.9, gt=0, le=1)


class SpeculativeSpec(Strict):
    """vLLM n-gram speculative decoding (prompt lookup): fields as vLLM 0.26's SpeculativeConfig names them."""

    method: Literal["ngram"] = "ngram"
    num_speculative_tokens: int = Field(default=4, ge=1)
    prompt_lookup_max: int = Field(default=4, ge=1)
    prompt_lookup_min: int = Field(default=2, ge=1)

    @model_validator(mode="after")
    def _window(self) -> SpeculativeSpec:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min {self.prompt_lookup_min} exceeds prompt_lookup_max {self.prompt_lookup_max}"
            )
        return self


# vllm-bench: `vllm bench throughput` on an offline scenario, beside our vLLM figure (the harness cross-check).
EngineName = Literal["transformers", "vllm", "vllm-bench"]

# vLLM 0.26's mixed-precision (W4A16 and kin) linear kernels, by class name. vLLM takes the first one in
# its priority order that can run the layer on the GPU; VLLM_DISABLED_KERNELS (comma-separated class
# names) takes kernels out of the running, so forcing one means disabling the others.
MP_KERNELS = (
    "CutlassW4A8LinearKernel", "MacheteLinearKernel", "AllSparkLinearKernel", "MarlinLinearKernel",
    "ConchLinearKernel", "ExllamaLinearKernel", "BitBLASLinearKernel", "Dynamic4bitLinearKernel",
)


class SweepSpec(Strict):
    """A serving scenario's sweep over the vLLM settings that matter for a variant. Each point is a
    normal serving run with a few settings changed from vLLM's defaults (`default`, always run first).

    one-at-a-time: each listed value of each setting alone (1 + Σ values that differ from the default);
    grid: every combination. max_num_seqs null and kernel 'auto' are vLLM's own choice; enforce_eager
    false keeps CUDA graphs on; kv_cache_dtype 'auto' stores the KV cache in the model's dtype.

    min_gain_pct: how much more goodput at the SLO than the defaults a point needs to become the tuned
    config; below it the defaults are kept. Two H200 runs of the same W4A16 sweep put its FP8 KV point at
    -2.0% and +0.8% of the defaults: gains that small are run-to-run noise, not a better config."""

    max_num_seqs: tuple[Annotated[int, Field(ge=1)] | None, ...] = ()
    enforce_eager: tuple[bool, ...] = ()
    kv_cache_dtype: tuple[Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"], ...] = ()
    kernel: tuple[str, ...] = ()
    mode: Literal["one-at-a-time", "grid"] = "one-at-a-time"
    min_gain_pct: float = Field(3.0, ge=0)

    DEFAULTS: ClassVar[dict[str, Any]] = {"max_num_seqs": None, "enforce_eager": False,
                                          "kv_cache_dtype": "auto", "kernel": "auto"}

    @field_validator("kernel")
    @classmethod
    def _known_kernel(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for k in v:
            if k != "auto" and k not in MP_KERNELS:
                raise ValueError(f"unknown kernel {k!r}: use 'auto' or one of {list(MP_KERNELS)}")
        return v

    def points(self) -> list[dict[str, Any]]:
        """The settings of each point that differ from vLLM's defaults; the first is {} (the defaults)."""
        levers = {k: [x for x in dict.fromkeys(getattr(self, k)) if x != d] for k, d in self.DEFAULTS.items()}
        if self.mode == "one-at-a-time":
            return [{}] + [{k: x} for k, xs in levers.items() for x in xs]
        grid: list[dict[str, Any]] = [{}]
        for k, xs in levers.items():
            grid = [{**g, **extra} for g in grid for extra in ({}, *({k: x} for x in xs))]
        return grid


def sweep_label(point: dict[str, Any]) -> str:
    """A sweep point's name on its rows: 'default', or its settings, e.g. 'kv_cache_dtype=fp8,max_num_seqs=64'."""
    return ",".join(f"{k}={point[k]}" for k in sorted(point)) or "default"


class Sampling(Strict):
    """How each next token is picked, applied the same way by every engine: greedy at temperature 0, else sampled
    at `temperature` from the `top_p` nucleus of the `top_k` most likely tokens (0: no top-k)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0


GREEDY = Sampling()


class ScenarioBase(Strict):
    """What every speed workload has: the same prompts and output lengths for every engine (EOS ignored), the
    engines, and the levers of the engine they start. A scenario is one of the kinds below (`ScenarioSpec`)."""

    engines: tuple[EngineName, ...] = ("transformers", "vllm")
    num_prompts: int = Field(default=8, ge=1)
    input_len: int = Field(default=64, ge=1)
    output_len: int = Field(default=32, ge=2)
    prompts_file: str | None = None
    warmup: int = Field(default=1, ge=0)
    repetitions: int = Field(default=3, ge=1)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    enable_prefix_caching: bool = False
    seed: int = 0
    # 0: greedy. Above 0: sampling at this temperature, with `top_p` (nucleus) and `top_k` (0: off), the same
    # on every engine; `vllm bench throughput` always samples at temperature 1.0, top-p 1, no top-k, so only
    # such a scenario is cross-checked. Only the sampler's cost changes: EOS is ignored, so every request still
    # yields output_len tokens.
    temperature: float = Field(default=0.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=0)
    # None: input_len + output_len. Scenarios that share an engine process must agree on it.
    max_model_len: int | None = Field(default=None, ge=2)
    # The first shared_prefix_len tokens of every prompt are the same (a common system prompt).
    shared_prefix_len: int = Field(default=0, ge=0)
    # Levers.
    enforce_eager: bool = False
    speculative: SpeculativeSpec | None = None
    transformers_compile: bool = False
    tensor_parallel_size: int = Field(default=1, ge=1)
    gpu_memory_utilization: float | None = Field(default=None, gt=0, le=1)
    max_cudagraph_capture_size: int | None = Field(default=None, ge=1)
    # dummy: speed only, random weights (a checkpoint folder without weight files is initialised randomly).
    weights: Literal["real", "dummy"] = "real"
    # Measured on the base checkpoint only: a check of the harness (e.g. the vllm-bench cross-check), not a
    # figure any variant is judged by.
    base_only: bool = False
    # Engines of `engines` that measure the base alone. Transformers decompresses a compressed-tensors checkpoint
    # to 16 bits as it loads it, so a variant under it runs the base's kernels: its figure says nothing of the
    # variant, and the vLLM-over-Transformers ratio is the base's.
    base_only_engines: tuple[EngineName, ...] = ()
    # Transformers on a compressed-tensors variant (AWQ, GPTQ, INT8, FP8 builds of llm-compressor) decompresses
    # it to 16 bits as it loads, so it would time the base's kernels again: such a row is skipped with that
    # reason unless the scenario asks for it (e.g. to measure what decompression costs at load).
    transformers_decompressed: bool = False

    @field_validator("repetitions")
    @classmethod
    def _odd(cls, v: int) -> int:
        if v % 2 == 0:
            raise ValueError(f"repetitions must be odd so the median is a measured run, got {v}")
        return v

    @field_validator("speculative", mode="before")
    @classmethod
    def _method_name(cls, v: object) -> object:
        return {"method": v} if isinstance(v, str) else v

    @model_validator(mode="after")
    def _consistent(self) -> ScenarioBase:
        if self.shared_prefix_len >= self.input_len:
            raise ValueError(
                f"shared_prefix_len {self.shared_prefix_len} must be shorter than input_len {self.input_len}"
            )
        if self.max_model_len is not None and self.max_model_len < self.input_len + self.output_len:
            needed = self.input_len + self.output_len
            raise ValueError(f"max_model_len {self.max_model_len} is below input_len + output_len ({needed})")
        if stray := [e for e in self.base_only_engines if e not in self.engines]:
            raise ValueError(f"base_only_engines {stray} are not among the scenario's engines {list(self.engines)}")
        if self.temperature == 0 and (self.top_p != 1 or self.top_k):
            raise ValueError("top_p and top_k shape sampling: set a temperature above 0 (0 is greedy)")
        if self.transformers_compile and "transformers" not in self.engines:
            raise ValueError("transformers_compile needs the transformers engine in engines")
        for lever, on in (("speculative", self.speculative), ("tensor_parallel_size", self.tensor_parallel_size > 1)):
            if on and "vllm" not in self.engines:
                raise ValueError(f"{lever} is a vllm lever; add vllm to engines")
        return self

    @property
    def model_len(self) -> int:
        return self.max_model_len or self.input_len + self.output_len

    @property
    def sampling(self) -> Sampling:
        return Sampling(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)


class SessionScenario(ScenarioBase):
    """A scenario timed in passes inside one engine session (offline, latency)."""

    # On a variant, its passes alternate with the base's, both loaded in the variant's engine process (base,
    # variant, variant, base, ...), and the speedup is read from those pairs: at a size where the host paces a
    # decode step, the host's drift between two windows minutes apart moved a ratio by 20% or more
    # (tasks/steps/benchmark.py). Off: the variant's passes alone, its ratio to the base's own session.
    paired: bool = True


class OfflineScenario(SessionScenario):
    """All prompts as fast as possible: vLLM takes them in one call and schedules them itself (as `vllm bench
    throughput` does, which cross-checks it), Transformers runs static batches of batch_size."""

    kind: Literal["offline"] = "offline"
    batch_size: int = Field(default=8, ge=1)
    # How each timed pass hands vLLM its prompts. token_ids: as ids, the engine's work alone. text: as the text
    # prompts `vllm bench throughput` makes for its random dataset (vLLM's own RandomDataset at this seed), which
    # the engine tokenizes inside the pass, as the bench's passes do: a cross-check times the same work both sides.
    prompt_input: Literal["token_ids", "text"] = "token_ids"

    @model_validator(mode="after")
    def _text_on_vllm(self) -> OfflineScenario:
        if self.prompt_input == "text":
            if "transformers" in self.engines:
                raise ValueError("prompt_input 'text' is for vllm and vllm-bench; transformers takes token ids")
            if self.prompts_file or self.shared_prefix_len:
                raise ValueError("prompt_input 'text' takes the bench's random prompts: no prompts_file or "
                                 "shared_prefix_len")
        return self

    def most_in_flight(self) -> int:
        """The most sequences the scenario may have in flight at once: all of a pass."""
        return self.num_prompts


class LatencyScenario(SessionScenario):
    """One request at a time."""

    kind: Literal["latency"] = "latency"

    @model_validator(mode="after")
    def _no_bench(self) -> LatencyScenario:
        if "vllm-bench" in self.engines:
            raise ValueError("vllm-bench measures offline throughput; kind 'latency' has no bench")
        return self

    def most_in_flight(self) -> int:
        return 1


class ServingScenario(ScenarioBase):
    """A `vllm serve` process driven at each `concurrency` (closed loop) and each Poisson `request_rates`."""

    kind: Literal["serving"] = "serving"
    engines: tuple[EngineName, ...] = ("vllm",)
    # Each concurrency level sends `rounds` x level prompts (num_prompts when rounds is unset); each request
    # rate sends num_prompts.
    concurrency: tuple[Annotated[int, Field(ge=1)], ...] = ()
    request_rates: tuple[Annotated[float, Field(gt=0)], ...] = ()
    rounds: int | None = Field(default=None, ge=1)
    slo: SloSpec | None = None
    # The scenario run once per point of a sweep of vLLM settings (each a plain serving run).
    sweep: SweepSpec | None = None

    @model_validator(mode="after")
    def _served(self) -> ServingScenario:
        if not (self.concurrency or self.request_rates):
            raise ValueError("a serving scenario needs concurrency levels or request_rates")
        if tuple(self.engines) != ("vllm",):
            raise ValueError(f"a serving scenario runs on vllm alone (engines: [vllm]), got {list(self.engines)}")
        if self.sweep is not None and self.enforce_eager and self.sweep.enforce_eager:
            raise ValueError("a sweep over enforce_eager needs the scenario's enforce_eager false (vLLM's default)")
        return self

    def load_sizes(self) -> list[tuple[str, int | None, float | None, int]]:
        """Serving loads in order: (label, max_concurrency, request_rate, number of prompts)."""
        loads: list[tuple[str, int | None, float | None, int]] = [
            (f"c={c}", c, None, c * self.rounds if self.rounds else self.num_prompts) for c in self.concurrency
        ]
        loads += [(f"rate={r:g}", None, r, self.num_prompts) for r in self.request_rates]
        return loads

    def most_in_flight(self) -> int:
        """A load's concurrency at most (a rate: every prompt of it, at worst)."""
        return max(n if rate is not None else min(c or n, n) for _, c, rate, n in self.load_sizes())


# A mapping without `kind` is an offline scenario, as before scenarios had kinds of their own fields.
ScenarioSpec = Annotated[
    Annotated[OfflineScenario, Tag("offline")] | Annotated[LatencyScenario, Tag("latency")]
    | Annotated[ServingScenario, Tag("serving")],
    kind_or("offline"),
]
_SCENARIOS: TypeAdapter[ScenarioSpec] = TypeAdapter(ScenarioSpec)


def scenario_from(data: Any) -> ScenarioSpec:
    """The scenario of its kind that a mapping (or a scenario) describes, validated."""
    return _SCENARIOS.validate_python(data)


# `vllm bench throughput` always samples at temperature 1.0, top-p 1.0.
BENCH_TEMPERATURE = 1.0


def bench_mismatch(scenario: ScenarioSpec) -> str | None:
    """Why `vllm bench throughput` would not run the scenario's config, or None."""
    if scenario.temperature != BENCH_TEMPERATURE or scenario.top_p != 1 or scenario.top_k:
        return (f"vllm bench throughput samples at temperature {BENCH_TEMPERATURE:g} (top-p 1, no top-k), the"
                f" scenario at {scenario.temperature:g} (top-p {scenario.top_p:g}, top-k {scenario.top_k or 'off'}):"
                f" cross-check a twin of it with temperature: {BENCH_TEMPERATURE:g} and neither")
    if not isinstance(scenario, OfflineScenario) or scenario.prompt_input != "text":
        return ("vllm bench throughput tokenizes its random dataset's text prompts inside each timed pass: "
                "cross-check a twin of the scenario with prompt_input: text")
    return None
