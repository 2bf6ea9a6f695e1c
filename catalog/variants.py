"""Quantized builds (`variants:`) and the calibration sets they are built with (`calibrations:`,
`models[].calibration`)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, Tag, model_validator

from quantgate.catalog.spec import Strict, kind_or

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


# A mapping without `kind` is plain text, as calibration blocks were before there were kinds.
CalibrationSpec = Annotated[
    Annotated[TextCalibration, Tag("text")] | Annotated[ChatCalibration, Tag("chat")]
    | Annotated[EvalHoldoutCalibration, Tag("eval_holdout")],
    kind_or("text"),
]
