"""A build checked before anything evaluates it: its checkpoint loads in Transformers with every tensor in its
place, and its logits on a fixed text are as close to its base's as its scheme is expected to keep them.

The error is relative, ‖v − b‖ / ‖b‖ over every position of the text, each position's logits centred first
(softmax ignores a constant shift; a model's logits may all sit far from 0). So it reads the same for a trained
model and for random weights of a model's shape, whose logits are all small: a build whose logits are the same for
every token (it carries nothing) scores 1.0, one whose logits are unrelated to its base's about 1.4. Deep random
weights compound rounding noise past a scheme's tolerance, so their builds are held only to "not unrelated".

It runs on the CPU, in host memory, so that it needs no GPU memory beyond what the build was promised: in float32
where there is no GPU (as CPU builds are), else in bfloat16, the dtype GPU builds are made in, at half the memory.
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from quantgate.catalog.errors import one_line

# A fixed text: two plain English sentences, the first with every letter. 64 tokens at most of any tokenizer.
PROBE_TEXT = ("The quick brown fox jumps over the lazy dog. Once upon a time, there was a little girl who loved to"
              " read books about the sea, and every evening she told her brother what she had read.")
PROBE_TOKENS = 64

# The most relative logit error a correct build of each scheme is expected to show, with a margin: seen on the CPU
# for 4-bit (AWQ, GPTQ, RTN), 8-bit, FP8 and 2-bit builds of SmolLM2-135M-Instruct (the demo's model, dequantized
# from its Q4_1 GGUF; the largest errors of all), stories260k (a trained 5-layer Llama), and tiny random-weight
# Llama, Qwen2, Qwen3, Mistral, Gemma 2 and 3, Phi-3, Qwen2-MoE and Qwen3-MoE models (hidden size 64; Gemma's twice
# the others'). For scale: one layer's down_proj or o_proj zeroed scores 0.14-0.89 on SmolLM2 and 0.11-0.37 on
# stories260k; weights that load as garbage (unpacked wrong, made at random) 1.0 and over.
#
# 8-bit integer weights, per channel (W8A16, bitsandbytes LLM.int8() with its outliers in 16 bits): 255 levels;
# seen 0.045 on SmolLM2, 0.006-0.022 on the others. Most single damaged layers are over it.
INT8_TOLERANCE = 0.15
# Activations quantized per token as well: FP8 E4M3 (3 mantissa bits, a rounding error of up to 1/16 of each weight
# and activation; seen 0.13 on SmolLM2, 0.03-0.08 on the others) and W8A8, whose int8 activations lose as much where
# a few channels carry outsized activations.
PER_TOKEN_TOLERANCE = 0.30
# 4-bit weights (W4A16 symmetric and asymmetric, bitsandbytes NF4 / FP4): 16 levels per group; seen 0.39 (AWQ) and
# 0.49 (GPTQ) at group 64 on SmolLM2, 0.07-0.22 on the others, 0.33 for bitsandbytes FP4 on Gemma. A single damaged
# layer hides in that; what this catches at 4 bits is a build that loads as garbage.
INT4_TOLERANCE = 0.80
# 2-bit weights may keep nothing of the base (SmolLM2's RTN build at group 32: 1.32, near unrelated logits' 1.41;
# stories260k's 0.58): the quality gate judges how much. Caught here: logits further off than unrelated ones of the
# base's own scale would be (a scale gone wrong).
INT2_TOLERANCE = 1.5
TOLERANCE = {
    "W8A16": INT8_TOLERANCE, "int8": INT8_TOLERANCE,
    "W8A8": PER_TOKEN_TOLERANCE, "FP8_DYNAMIC": PER_TOKEN_TOLERANCE,
    "W4A16": INT4_TOLERANCE, "W4A16_ASYM": INT4_TOLERANCE, "nf4": INT4_TOLERANCE, "fp4": INT4_TOLERANCE,
    "W2A16": INT2_TOLERANCE,
}  # fmt: skip


def check_dtype() -> str:
    return "bfloat16" if torch.cuda.is_available() else "float32"


def probe_ids(tokenizer_path: str | Path) -> torch.Tensor:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    return tokenizer(PROBE_TEXT, return_tensors="pt").input_ids[:, :PROBE_TOKENS]


def centred_logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    """The model's logits at every position of `ids`, float32 on the CPU, each position's mean subtracted."""
    with torch.inference_mode():
        logits = model(ids.to(model.device)).logits[0].float().cpu()
    return logits - logits.mean(dim=-1, keepdim=True)


@functools.lru_cache(maxsize=2)
def base_logits(base_path: str, dtype: str) -> torch.Tensor:
    """The base's centred logits on the probe; kept, since every build of a model is checked against them."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=getattr(torch, dtype))
    return centred_logits(base, probe_ids(base_path))


def logit_error(variant: torch.Tensor, base: torch.Tensor) -> float:
    return float((variant - base).norm() / base.norm().clamp_min(torch.finfo(torch.float32).tiny))


# Random weights of a deep model (a shape run) carry no structure for a scheme to keep: rounding noise compounds
# through the layers. Seen on Qwen2.5-7B's shape (28 layers, H200, benchmarks/results/h200/shape7b-1): FP8 0.536,
# GPTQ 0.974, AWQ 1.062 at W4A16 g128, each over its scheme's tolerance for a correct build. What the check still
# tells there is a build unrelated to its base (about √2, 1.41): the ceiling for random weights, whatever the scheme.
RANDOM_WEIGHTS_TOLERANCE = 1.3


def judged(error: float, scheme: str, tokens: int, random_weights: bool = False) -> str | None:
    """Why a build whose logit error is `error` is wrong for its scheme (one line), or None. A build of random
    weights is held to RANDOM_WEIGHTS_TOLERANCE, not its scheme's."""
    tolerance, what = ((RANDOM_WEIGHTS_TOLERANCE, "random weights'") if random_weights
                       else (TOLERANCE[scheme], scheme))
    if error <= tolerance:
        return None
    return (f"its logits are off its base's by {error:.3f} (relative, {tokens} fixed tokens), over the {what}"
            f" tolerance {tolerance}: the checkpoint does not compute what its base does")


def _load_problem(info: dict[str, Any]) -> str | None:
    missing, unexpected = sorted(info.get("missing_keys") or ()), sorted(info.get("unexpected_keys") or ())
    if not missing and not unexpected:
        return None
    parts = [f"{len(missing)} tensors missing ({missing[0]}, ...) that Transformers made at random"] if missing else []
    parts += [f"{len(unexpected)} tensors it does not use ({unexpected[0]}, ...)"] if unexpected else []
    return f"it loads wrong in Transformers: {'; '.join(parts)}"


# Transformers 5 writes a weight conversion that failed (e.g. merging a checkpoint's experts into its fused expert
# tensors) into its load report, a warning, and raises only "... look at the `CONVERSION` entries of the above
# report!", a report a run's one line does not show: its first error and where it was going are read from it.
_ERROR_LINE = re.compile(r"^(\w+(?:Error|Exception): \S.*)$", re.M)
_TARGET_LINE = re.compile(r"^Error: (.+? on tensors destined for \S+?)\.? Ckpt contains", re.M)
_STYLE = re.compile(r"\x1b\[[0-9;]*m")


class _Report(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(_STYLE.sub("", record.getMessage()))


@contextmanager
def _load_report() -> Iterator[list[str]]:
    """What Transformers warns while a checkpoint loads (its load report among it)."""
    handler, library = _Report(), logging.getLogger("transformers")
    library.addHandler(handler)
    try:
        yield handler.messages
    finally:
        library.removeHandler(handler)


def conversion_error(report: list[str]) -> str | None:
    """The first failed weight conversion of a load report, in one line (its error, and its target), or None."""
    text = "\n".join(report)
    if (error := _ERROR_LINE.search(text)) is None:
        return None
    target = _TARGET_LINE.search(text, error.end())
    return error.group(1)[:200] + (f" ({target.group(1)})" if target else "")


def checkpoint_problem(base_path: str | Path, build_path: str | Path, scheme: str,
                       random_weights: bool = False) -> str | None:
    """Why the checkpoint at `build_path`, a build of `base_path` with `scheme`, is wrong (one line), or None
    (`random_weights`: the base's weights are random, judged())."""
    from transformers import AutoModelForCausalLM

    with _load_report() as report:
        try:
            model, info = AutoModelForCausalLM.from_pretrained(build_path, dtype=getattr(torch, check_dtype()),
                                                               output_loading_info=True)
        except Exception as e:  # whatever stops the load is the finding, in one line
            converted = conversion_error(report) if "CONVERSION" in str(e) else None
            why = f"a weight conversion failed: {converted}" if converted else one_line(e)
            return f"it does not load in Transformers: {why}"
    return _load_problem(info) or loaded_problem(model, base_path, scheme, random_weights)


def loaded_problem(model: Any, base_path: str | Path, scheme: str, random_weights: bool = False) -> str | None:
    """Why `model`, a build of `base_path` with `scheme` as loaded (a bitsandbytes variant is quantized as it
    loads), computes what its base does not (one line), or None."""
    logits = centred_logits(model, probe_ids(base_path))
    if not torch.isfinite(logits).all():
        return "its logits contain NaN/Inf"  # finite weights may still overflow (a huge scale)
    base = base_logits(str(base_path), check_dtype())
    return judged(logit_error(logits, base), scheme, base.shape[0], random_weights)
