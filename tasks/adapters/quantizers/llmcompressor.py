"""llm-compressor behind one call: a local Hugging Face checkpoint in, a compressed-tensors checkpoint out.

This is the only module that imports llmcompressor.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import yaml
from compressed_tensors.quantization import QuantizationScheme, preset_name_to_scheme
from compressed_tensors.utils import match_named_modules
from datasets import Dataset
from llmcompressor import oneshot
from llmcompressor.modifiers import Modifier
from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
from llmcompressor.modifiers.transform import AWQModifier
from llmcompressor.pipelines.cache import IntermediatesCache
from llmcompressor.recipe import Recipe
from llmcompressor.sentinel import Sentinel
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from quantgate.catalog.errors import QuantgateError
from quantgate.catalog.records import CalibrationSamples
from quantgate.catalog.variants import VariantSpec
from quantgate.tasks.adapters.quantizers.batching import calibration_batch_size

TARGETS = ["Linear"]


class QuantizeError(QuantgateError, RuntimeError):
    """A build that cannot work for this model and spec; the message is one line."""


def _scheme(spec: VariantSpec) -> str | QuantizationScheme:
    """The preset name when the spec matches a preset as is, else a full scheme."""
    # W2A16 has no preset: W4A16 (symmetric int, grouped) with 2-bit weights.
    preset = preset_name_to_scheme("W4A16" if spec.scheme == "W2A16" else spec.scheme, TARGETS)
    weights = preset.weights.model_copy(update={"num_bits": spec.bits})
    if weights == preset.weights and weights.group_size == spec.group_size:
        return spec.scheme
    if spec.group_size is None:
        weights = weights.model_copy(update={"strategy": "channel", "group_size": None})
    else:
        weights = weights.model_copy(update={"strategy": "group", "group_size": spec.group_size})
    return preset.model_copy(update={"weights": weights})


def modifiers(spec: VariantSpec) -> list[Modifier]:
    scheme = _scheme(spec)
    quant = {"targets": TARGETS, "ignore": list(spec.ignore)}
    quant |= {"scheme": scheme} if isinstance(scheme, str) else {"config_groups": {"group_0": scheme}}
    match spec.method:
        case "awq":
            return [AWQModifier(), QuantizationModifier(**quant)]
        case "gptq":
            return [GPTQModifier(**quant)]
        case "rtn" | "fp8":
            return [QuantizationModifier(**quant)]
    raise ValueError(f"unknown method {spec.method!r}")


def _plain(value: object) -> object:
    """Drop "not provided" sentinels: they dump as Python objects holding an install path."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items() if not isinstance(v, Sentinel)}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def recipe_text(spec: VariantSpec) -> str:
    """The recipe as llm-compressor serialises it (stage / modifier group / modifier: args).

    It is plain YAML (safe_dump fails on anything else), so it hashes the same everywhere
    and is exactly what `quantize` hands to oneshot.
    """
    recipe = _plain(Recipe.from_modifiers(modifiers(spec)).to_dict())
    return yaml.safe_dump(recipe, sort_keys=False, default_flow_style=None, width=88)


def _check_group_size(model: PreTrainedModel, spec: VariantSpec) -> None:
    # llm-compressor checks this later, with a multi-line message, and lets layers narrower
    # than the group through, which then fail in compressed-tensors ("unflatten: Provided
    # sizes [-1, 128] don't multiply up ..."). One rule here, one line, before any work.
    if spec.group_size is None:
        return
    bad = [
        (name, module.weight.shape[-1])
        for name, module in match_named_modules(model, TARGETS, list(spec.ignore))
        if module.weight.shape[-1] % spec.group_size
    ]
    if bad:
        name, cols = bad[0]
        more = f" (and {len(bad) - 1} more layers)" if len(bad) > 1 else ""
        raise QuantizeError(f"group size {spec.group_size} does not divide in_features {cols} of {name}{more}")


@contextmanager
def _awq_without_pinning(spec: VariantSpec) -> Iterator[None]:
    # llm-compressor 0.14's AWQ pins its cached activations (IntermediatesCache.pin_memory,
    # only AWQ calls it) for faster host-to-device copies. Pinning needs an accelerator: on
    # a CPU-only machine it raises "Cannot access accelerator device when none is available".
    # Upstream PR #2813 moves the pinning; until then skip it for CPU AWQ runs only.
    if spec.method != "awq" or torch.accelerator.is_available():
        yield
        return
    pin_memory = IntermediatesCache.pin_memory
    IntermediatesCache.pin_memory = lambda self, *args, **kwargs: None
    try:
        yield
    finally:
        IntermediatesCache.pin_memory = pin_memory


def _load(model_dir: Path, calibrated: bool) -> PreTrainedModel:
    if torch.cuda.is_available():
        # Calibrated methods run llm-compressor's sequential pipeline, which onloads one
        # layer at a time to the GPU, so the model stays in CPU memory (llm-compressor's
        # advice, and models larger than the GPU still fit); data-free ones run in place.
        return AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.bfloat16, device_map=None if calibrated else "cuda"
        )
    # A CPU builds in float32, whatever the checkpoint stores (a GGUF base is bf16): its bf16 matrix products are
    # slower (GPTQ of the SmolLM2 demo took 502 s in bf16 on a busy 2-core machine; ~45 s in fp32 before).
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def quantize(model_dir: Path, spec: VariantSpec, samples: CalibrationSamples | None, out_dir: Path) -> None:
    """Quantize `model_dir` per `spec` into `out_dir` (compressed-tensors weights, recipe.yaml, tokenizer).

    `samples` calibrate the build when the spec needs calibration: token ids, already rendered and tokenized,
    reach oneshot as they are.
    """
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = _load(model_dir, spec.needs_calibration)
    _check_group_size(model, spec)
    calibration: dict = {}
    if spec.needs_calibration:
        if not samples or not samples.input_ids:
            raise QuantizeError(f"method {spec.method} needs calibration samples, got none")
        ids = [list(s) for s in samples.input_ids]
        calibration = {
            "dataset": Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * len(s) for s in ids]}),
            "num_calibration_samples": len(ids),
            "max_seq_length": samples.seq_len,
            "shuffle_calibration_samples": False,
            # Every sample has seq_len tokens, so batches hold no padding, and what calibrates is the same
            # whatever the batching: AWQ sums activations and squared errors over all tokens and divides by
            # their count, GPTQ sums 2·x·xᵀ over all tokens and divides by the sample count; only the float
            # summation order changes.
            "batch_size": calibration_batch_size(len(ids), samples.seq_len),
        }
    with _awq_without_pinning(spec):
        oneshot(
            model=model,
            tokenizer=tokenizer,
            recipe=recipe_text(spec),
            **calibration,
            output_dir=str(out_dir),
            save_compressed=True,
            # Drop the global session's hold on the model once saved, so builds in one
            # process do not keep earlier models alive (in GPU memory, for data-free runs).
            clear_sparse_session=True,
        )
