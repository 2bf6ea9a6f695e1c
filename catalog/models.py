"""A catalog model (`models:`): its source, variants, suite, scenarios, calibration, policy and published figures."""

from __future__ import annotations

from pydantic import Field, model_validator

from quantgate.catalog.policy import Policy
from quantgate.catalog.sources import Source
from quantgate.catalog.spec import Strict
from quantgate.catalog.variants import CalibrationSpec, TextCalibration

# Metrics lm-eval reports as a fraction in [0, 1]; a published figure for one is written the same way.
FRACTION_METRICS = ("acc", "acc_norm", "exact_match")


class PublishedFigure(Strict):
    """A score the model's makers published for one of its gated checks (a quality gate's task and metric),
    shown beside the base's measured value (benchmarks/readme_verdicts.py). `value` is in the metric's own units
    as lm-eval reports it (accuracy 0.602, not 60.2); `protocol` is the publisher's (shots, chain of thought, base
    or instruct model); `source` cites where it is printed (document, version, table).

    `tolerance` is how far, in the same units, the protocol differences the entry states may move the base from
    `value`: with it, the decision checks the base (tasks/steps/decide.py): a base whose interval lies wholly
    outside value ± tolerance does not measure like the model it claims to be (a wrong chat template, a broken
    conversion, a truncated download), and every variant's verdict is not_comparable. Without it the figure is
    shown, never checked."""

    task: str
    metric: str
    value: float = Field(ge=0, allow_inf_nan=False)
    protocol: str = Field(min_length=1)
    source: str = Field(min_length=1)
    tolerance: float | None = Field(default=None, gt=0, allow_inf_nan=False)

    @model_validator(mode="after")
    def _fraction(self) -> PublishedFigure:
        if self.metric in FRACTION_METRICS and self.value > 1:
            raise ValueError(f"{self.metric} is a fraction in [0, 1], got {self.value:g}"
                             f" (a percentage? write {self.value / 100:g})")
        if self.metric in FRACTION_METRICS and self.tolerance is not None and self.tolerance > 1:
            raise ValueError(f"tolerance of a fraction is a fraction too, got {self.tolerance:g}"
                             f" (a percentage? write {self.tolerance / 100:g})")
        return self


class PublishedRecovery(Strict):
    """How much of a gated task's score a quantized build kept, as another party published it for the nearest
    model it measured (not this one): an external check of the direction of this model's verdicts, shown beside
    our recovery of the variant of the same `method` and `bits` (benchmarks/readme_verdicts.py); no gate reads
    it. `recovery` is the build's score over its bf16 original's, computed from the published pair."""

    model: str = Field(min_length=1)
    build: str = Field(min_length=1)
    method: str = Field(min_length=1)
    bits: int = Field(ge=1, le=16)
    task: str
    metric: str
    recovery: float = Field(gt=0, allow_inf_nan=False)
    protocol: str = Field(min_length=1)
    source: str = Field(min_length=1)


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
    # Published figures for its gated checks, one per check, with their source: shown beside the base's scores and,
    # with a tolerance, checked against them (not_comparable outside it).
    published: tuple[PublishedFigure, ...] = ()
    # Published recoveries of quantized builds of the nearest model their publisher measured, with their source.
    published_recoveries: tuple[PublishedRecovery, ...] = ()
