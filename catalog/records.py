"""Plain, serialisable records that cross the rooms: what tasks return, the warehouse stores and flows pass on."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any, Literal


# Why a run on a model's shape (random weights) measures no quality: its scores are noise around chance. Its
# quality checks, the end-of-run verdicts and the report say it in these words.
RANDOM_WEIGHTS = "random weights (a run on the model's shape): quality is not measured"


@dataclass(frozen=True)
class Provenance:
    """Whether a base's weights passed through quantization before quantgate got them, and as what: a GGUF file
    (its quant type: `Q4_K_M`; F32, F16 and BF16 files are not quantized), a checkpoint whose config.json carries a
    `quantization_config` (its `quant_method`: fp8, gptq, awq, compressed-tensors) or one saved by bitsandbytes.
    A variant's recovery is a ratio to such a base, so it says what a second quantization kept of an already
    quantized model, not of the 16-bit release; verdicts and reports say so in the words of `label`."""

    quantized: bool
    via: Literal["gguf", "quantization_config", "bitsandbytes"]
    # The GGUF's file type (Q4_K_M), or the config's quant_method (fp8) or bitsandbytes' type (nf4, int8).
    quant_type: str | None = None
    bits: int | None = None
    # Where it was read: the GGUF's general.file_type, its tensor types, its file name, or config.json.
    evidence: str = ""

    @property
    def label(self) -> str:
        """How verdicts name the base: `Q4_K_M GGUF`, `8-bit fp8 (quantization_config)`, `bitsandbytes 4-bit nf4`."""
        kind = self.quant_type or "quantized"
        if self.via == "gguf":
            return f"{kind} GGUF"
        bits = f"{self.bits}-bit " if self.bits else ""
        return f"bitsandbytes {bits}{kind}" if self.via == "bitsandbytes" else f"{bits}{kind} (quantization_config)"


@dataclass(frozen=True)
class ModelArtifact:
    """A model checkpoint on local disk, identified by content (local) or commit (hub)."""

    model_id: str
    path: str
    source: Literal["hub", "local", "gguf", "shape"]
    revision: str | None
    sha: str
    architecture: str | None = None
    num_parameters: int | None = None
    size_bytes: int = 0
    # A run on the model's shape (a `shape` source): its weights are random, so its speed, memory and time are
    # real and its quality is not measured.
    random_weights: bool = False
    # Whether the weights passed through quantization before quantgate got them (None: no sign that they did).
    provenance: Provenance | None = None

    @property
    def uid(self) -> str:
        return f"{self.model_id}@{self.sha[:12]}"


@dataclass(frozen=True)
class VariantArtifact:
    """A quantized (or the base) checkpoint and how it was built."""

    uid: str
    model_uid: str
    name: str
    method: str
    scheme: str | None
    bits: int | None
    group_size: int | None
    path: str | None
    recipe: str | None
    recipe_hash: str | None
    lib_versions: dict[str, str] = field(default_factory=dict)
    size_bytes: int | None = None
    build_seconds: float | None = None
    peak_memory_bytes: int | None = None
    # "skipped": not built because its backend cannot run here (bitsandbytes absent, no backend for the device), or
    # refused before any work for its model's family (catalog/families.yaml).
    status: Literal["built", "failed", "skipped"] = "built"
    error: str | None = None
    reused: bool = False
    # "dummy": random weights of a real shape, for speed runs only (never evaluated or decided).
    weights: Literal["real", "dummy"] = "real"

    @property
    def ok(self) -> bool:
        return self.status == "built"


@dataclass(frozen=True)
class CalibrationSamples:
    """A calibration set as it reaches the quantizer: `input_ids` of exactly `seq_len` tokens each, rendered
    (chat template) and tokenized once by the model's own tokenizer; `label` names the set."""

    label: str
    seq_len: int
    input_ids: tuple[tuple[int, ...], ...]

    @property
    def fingerprint(self) -> str:
        """sha256 over every sample's content hash: any change of data, template, tokenizer or size changes it."""
        digests = [hashlib.sha256(json.dumps(ids).encode()).hexdigest() for ids in self.input_ids]
        return hashlib.sha256(json.dumps([self.seq_len, digests]).encode()).hexdigest()


@dataclass(frozen=True)
class LocalTaskConfig:
    """One leaf lm-eval task of a local YAML (a group's member, or the task itself) as lm-eval merges its
    config (includes first, own keys win; each !function as {"!function": name, "sha256": ...})."""

    name: str
    yaml_path: str
    config: dict[str, Any]


@dataclass(frozen=True)
class MetricResult:
    task: str
    metric: str
    filter: str
    value: float | None
    stderr: float | None
    n_samples: int | None
    task_version: str | None
    higher_is_better: bool | None


@dataclass(frozen=True)
class SampleResult:
    task: str
    doc_id: int
    metric: str
    value: float | None
    detail: dict[str, Any]
    # lm-eval logs a task's samples once per filter (e.g. gsm8k: strict-match, flexible-extract).
    filter: str = "none"


@dataclass(frozen=True)
class QualityReport:
    """All metrics and per-sample results of one suite on one variant."""

    eval_key: str
    evaluator: str
    config: dict[str, Any]
    metrics: list[MetricResult]
    samples: list[SampleResult]
    seconds: float
    status: Literal["ok", "failed"] = "ok"
    error: str | None = None


@dataclass(frozen=True)
class SpeedResult:
    """One (engine, scenario) measurement; medians over repetitions, spread kept beside them."""

    engine: str
    scenario: str
    status: Literal["ok", "skipped", "failed"]
    reason: str | None
    config: dict[str, Any]
    device: str | None = None
    num_requests: int | None = None
    input_tokens: int | None = None
    output_tokens: int | None = None
    tokens_per_s: float | None = None
    requests_per_s: float | None = None
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None
    peak_memory_bytes: int | None = None
    energy_j_per_token: float | None = None
    repetitions: list[dict[str, Any]] = field(default_factory=list)
    versions: dict[str, str] = field(default_factory=dict)
    # (input + output) tokens per wall second, as `vllm bench throughput` counts its tokens/s.
    total_tokens_per_s: float | None = None
    # Batch-1 decode speed (1 / TPOT) against the memory-bandwidth roofline: weight bytes read per
    # decode step over the device bandwidth measured in the same process.
    decode_tokens_per_s: float | None = None
    bandwidth_gbps: float | None = None
    weight_bytes_per_token: int | None = None
    roofline_fraction: float | None = None
    # Memory beside peak_memory_bytes: the device's used memory (NVML) and this process's torch
    # allocator, each at its highest; vLLM's KV-cache budget.
    nvml_peak_bytes: int | None = None
    torch_peak_bytes: int | None = None
    kv_cache_tokens: int | None = None
    kv_cache_bytes: int | None = None
    # Anything else the run learnt: OOM retries, speculative-decoding acceptance, the bench command.
    details: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


# not_comparable: no verdict, because the ratios it would rest on are not to be trusted: the base measured outside
# its published figure's tolerance, or a variant scored above its base by more than rounding explains.
Verdict = Literal["accept", "reject", "inconclusive", "not_comparable"]
# baseline: the base itself, against its published figures and by its provenance (whether its weights passed
# through quantization before the run).
CheckKind = Literal["build", "quality", "speed", "serving", "size", "baseline"]
# not_measured: no evidence either way (an engine not run, an optional gate without a recovery).
# uninformative: measured, but the base is not clearly above the metric's chance level there, so the metric
# cannot tell what a build kept: it never passes, fails or decides.
# not_comparable: a baseline check whose base measured outside its published figure's tolerance.
# anomalous: a quality check whose variant scored above its base beyond the interval's noise and rounding's gain.
# Either makes the verdict not_comparable.
CheckOutcome = Literal["pass", "fail", "inconclusive", "not_measured", "uninformative", "not_comparable", "anomalous"]


@dataclass(frozen=True)
class DecisionCheck:
    """One check of a decision: what was compared with what, and how it came out."""

    kind: CheckKind
    name: str
    outcome: CheckOutcome
    note: str
    task: str | None = None
    metric: str | None = None
    value: float | None = None
    lower: float | None = None
    upper: float | None = None
    threshold: float | None = None
    # Quality only: the smallest recovery drop these items resolve at the policy's confidence, the items
    # judged, and (inconclusive) how many items with the same paired spread would decide it.
    min_detectable_drop: float | None = None
    items: int | None = None
    items_to_decide: int | None = None
    # The rest of the evidence, e.g. the interval's method, a flip rate, a serving check's tuned point.
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Decision:
    variant_uid: str
    decision: Verdict
    reason: str
    checks: list[DecisionCheck]
    policy_hash: str
    quality_recovery: float | None
    speedup: float | None
    size_ratio: float | None
    # Worst confidence-interval lower bound of recovery, and highest flip rate, over the gated metrics.
    quality_lower_bound: float | None = None
    flip_rate: float | None = None


# --- serving: one load run of an OpenAI-compatible server, request by request ---


@dataclass
class RequestRecord:
    """One request of a load run. Offsets are seconds from the start of the run."""

    index: int
    success: bool
    error: str | None
    prompt_len: int
    output_tokens: int
    ttft_s: float | None
    itl_s: list[float]
    e2el_s: float | None
    tpot_s: float | None
    arrival_offset_s: float  # when the request was due (Poisson schedule, or 0)
    start_offset_s: float  # when it was sent, after waiting for a concurrency slot
    server_metrics: dict[str, Any] | None = None  # vLLM's per-request timings, with --enable-per-request-metrics


@dataclass
class LoadRun:
    records: list[RequestRecord]
    duration_s: float
    model: str
    config: dict[str, Any]
    # What the server said about itself while answering: response headers (server, ...) and the
    # stream's `model` and `system_fingerprint` fields, from the first successful request.
    server_info: dict[str, Any] = field(default_factory=dict)


@dataclass
class ServingLoad:
    """One load of a serving scenario (a concurrency level or a request rate) and its requests."""

    label: str
    max_concurrency: int | None
    request_rate: float | None
    records: list[RequestRecord]
    duration_s: float
    energy_j: float | None = None
    server_info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Slo:
    """Service-level objective for goodput; a request is good when it meets every limit given."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None
    attainment: float = 0.9  # share of a load's requests that must be good for the load to meet it
