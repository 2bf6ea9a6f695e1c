"""The acceptance policy (`policy:`, a model's `policy:` file): quality, speed and serving gates."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from quantgate.catalog.spec import Strict, content_hash


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
    # What the threshold applies to: `plain` recovery (variant ÷ base) or recovery `above_chance`
    # ((variant − chance) ÷ (base − chance)), where the metric has a chance level (multiple choice: 1 / choices
    # per item; exact match: 0). Above chance reads a multiple-choice loss at its real size: from 0.40 to 0.35
    # on 4 choices is 0.875 plain but 0.67 above chance, a third of the skill over guessing gone.
    recovery: Literal["plain", "above_chance"] = "plain"


# Where the host paced the engine (host-bound: the engine's Python, not the GPU, set the pace of a decode step), a
# ratio of two checkpoints is the host's as much as theirs, and it moves from one machine to the next (the
# reference model's FP8 build measured 1.00x and 0.74x of its base on two H200 hosts). `uninformative` (the
# default) lets such a check decide nothing, as a quality gate at chance decides nothing; `decide` lets it decide
# (a fleet whose hosts are all like the one measured).
HostBound = Literal["uninformative", "decide"]


class SpeedGate(Strict):
    engine: Literal["transformers", "vllm"]
    scenario: str
    min_speedup: float = Field(gt=0)
    host_bound: HostBound = "uninformative"


class ServingGate(Strict):
    """The variant's goodput at the SLO on a serving scenario (its tuned serving config's, when the scenario
    sweeps vLLM settings) over the base's, in the same run."""

    scenario: str
    min_goodput_ratio: float = Field(gt=0)
    # The served checkpoints' vLLM engines host-bound in this run's offline or latency passes (HostBound).
    host_bound: HostBound = "uninformative"


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
    # A base whose weights passed through quantization before the run (a GGUF's Q4_K_M, a checkpoint's
    # quantization_config, bitsandbytes): every recovery is against that quantized model, not the 16-bit release.
    # `allow` lets such a base carry an accept, labelled ("recoveries are against a Q4_K_M GGUF base");
    # `inconclusive` makes that accept inconclusive, with the reason (a reject stays a reject).
    quantized_base: Literal["allow", "inconclusive"] = "allow"
    # The largest gain over the base (recovery - 1) that rounding the weights explains: a perturbation can gain a
    # little by chance (Qwen2-1.5B-Instruct's GPTQ-Int8 scored 1.011 of its bf16 MMLU in Qwen's own table). A check
    # whose interval's lower bound lies above 1 + max_gain is `anomalous` (a leak, a bug), and the verdict is
    # not_comparable.
    max_gain: float = Field(default=0.02, ge=0, le=1)

    @property
    def hash(self) -> str:
        return content_hash(self.model_dump(mode="json"))
