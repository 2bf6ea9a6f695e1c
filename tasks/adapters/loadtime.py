"""Load-time quantized variants (bitsandbytes): the base checkpoint plus a quantization config.

Such a variant has no weights of its own. Its folder (`variants/<uid>/`) holds the base's small files
(config, tokenizer, generation config: so tokenizers and config readers work on it as on any
checkpoint), no weight file (so a loader that ignores this module fails loudly instead of measuring
the unquantized base), and `quantgate-load.json`, which names the base folder and the bitsandbytes
config that Transformers applies when it loads the base. Every stage that loads weights goes through
`load_model`, which handles both kinds of folder.

This is the one module that imports bitsandbytes, and only inside functions: quantgate runs without it,
and a bnb variant is then recorded as skipped with the reason.
"""

from __future__ import annotations

import json
import logging
import shutil
import warnings
from pathlib import Path
from typing import Any

from quantgate.catalog.errors import QuantgateError
from quantgate.catalog.variants import VariantSpec

LOAD_FILE = "quantgate-load.json"
# Weights and their indexes stay with the base; everything else in its top folder is copied.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".h5", ".msgpack")
_WEIGHT_INDEXES = (".safetensors.index.json", ".bin.index.json")
# LLM.int8() casts fp32 inputs to fp16 and says so on every call (CPU runs in fp32).
_NOISE = r"MatMul8bitLt: inputs will be cast from torch\.float32 to float16"


class LoadTimeError(QuantgateError, RuntimeError):
    """A load-time variant folder that cannot be used; the message is one line."""


def config_kwargs(spec: VariantSpec) -> dict[str, Any]:
    """BitsAndBytesConfig arguments for a bnb spec, as plain JSON. The compute dtype is left out: it is
    the dtype the variant is loaded in (a property of the evaluation, part of its eval key)."""
    if spec.method != "bnb":
        raise ValueError(f"variant {spec.name!r} is method {spec.method!r}, not bnb")
    # Transformers matches each skipped module as a regular expression: llm-compressor's `re:` prefix comes off.
    skip = [p.removeprefix("re:") for p in spec.ignore]
    if spec.scheme == "int8":
        return {"load_in_8bit": True, "llm_int8_threshold": 6.0, "llm_int8_skip_modules": skip}
    return {"load_in_4bit": True, "bnb_4bit_quant_type": spec.scheme,
            "bnb_4bit_use_double_quant": spec.double_quant, "llm_int8_skip_modules": skip}


def recipe_text(spec: VariantSpec) -> str:
    """What the variant is, hashed into its uid: the bitsandbytes config as sorted JSON."""
    return json.dumps({"bitsandbytes": config_kwargs(spec)}, sort_keys=True, indent=2)


def unavailable(device: str) -> str | None:
    """Why bitsandbytes cannot run on `device` here, or None."""
    try:
        import bitsandbytes as bnb
    except ImportError as e:
        return f"bitsandbytes is not installed ({e}); pip install bitsandbytes"
    except Exception as e:  # a broken install (a native library that does not load) is the same for us
        return f"bitsandbytes does not import: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
    supported = getattr(bnb, "supported_torch_devices", None)
    if supported is not None and device not in supported:
        return f"bitsandbytes {bnb.__version__} has no {device} backend (it supports {sorted(supported)})"
    return None


def descriptor(path: str | Path) -> dict[str, Any] | None:
    """The load-time description of a variant folder, or None for an ordinary checkpoint."""
    file = Path(path) / LOAD_FILE
    if not file.is_file():
        return None
    try:
        desc = json.loads(file.read_text())
    except ValueError as e:
        raise LoadTimeError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(desc, dict) or "base_path" not in desc or "quantization_config" not in desc:
        raise LoadTimeError(f"{file}: needs base_path and quantization_config")
    return desc


def weights_path(path: str | Path) -> str:
    """The folder whose weight files a model at `path` is loaded from: the base's for a load-time variant."""
    desc = descriptor(path)
    return str(desc["base_path"]) if desc else str(path)


def write_folder(folder: Path, base_path: str | Path, spec: VariantSpec) -> None:
    """Lay out a load-time variant in `folder` (which must exist): the base's small files and LOAD_FILE."""
    base = Path(base_path).resolve()
    for item in sorted(base.iterdir()):
        name = item.name
        if not item.is_file() or name.endswith(_WEIGHT_SUFFIXES) or name.endswith(_WEIGHT_INDEXES):
            continue
        shutil.copyfile(item, folder / name)
    desc = {"base_path": str(base), "method": spec.method, "scheme": spec.scheme,
            "quantization_config": config_kwargs(spec)}
    (folder / LOAD_FILE).write_text(json.dumps(desc, indent=2, sort_keys=True))


class _Once(logging.Filter):
    """Lets each distinct message of a logger through once per process."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message in self.seen:
            return False
        self.seen.add(message)
        return True


def _log_once(name: str) -> None:
    # LLM.int8() logs "inputs will be cast from torch.bfloat16 to float16" on every matmul of every step
    # (144,000 lines in one H200 run); once says the same.
    logger = logging.getLogger(name)
    if not any(isinstance(f, _Once) for f in logger.filters):
        logger.addFilter(_Once())


def quantization_config(kwargs: dict[str, Any], dtype: Any) -> Any:
    """A transformers BitsAndBytesConfig computing in `dtype` (a torch dtype)."""
    from transformers import BitsAndBytesConfig

    extra = {"bnb_4bit_compute_dtype": dtype} if kwargs.get("load_in_4bit") else {}
    return BitsAndBytesConfig(**kwargs, **extra)


def load_model(path: str | Path, *, device: str = "cpu", dtype: str | Any = "float32",
               trust_remote_code: bool = False, **kwargs: Any) -> Any:
    """AutoModelForCausalLM for an ordinary checkpoint folder or a load-time variant, on `device`, in eval mode.

    `dtype` is a torch dtype, its name, or "auto" (the checkpoint's own). A load-time variant is placed by
    Transformers (device_map): bitsandbytes modules cannot be moved with .to() afterwards.
    """
    import torch
    from transformers import AutoModelForCausalLM

    torch_dtype = dtype if not isinstance(dtype, str) or dtype == "auto" else getattr(torch, dtype)
    desc = descriptor(path)
    if desc is None:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, trust_remote_code=trust_remote_code,
                                                     **kwargs)
        return model.to(device).eval()
    if (why := unavailable(device)) is not None:
        raise LoadTimeError(why)
    warnings.filterwarnings("ignore", message=_NOISE)
    _log_once("bitsandbytes.autograd._functions")
    compute = torch_dtype
    if compute == "auto":
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(desc["base_path"], trust_remote_code=trust_remote_code)
        compute = getattr(config, "dtype", None) or torch.float32
        compute = getattr(torch, compute) if isinstance(compute, str) else compute
    model = AutoModelForCausalLM.from_pretrained(
        desc["base_path"], dtype=torch_dtype, trust_remote_code=trust_remote_code,
        quantization_config=quantization_config(desc["quantization_config"], compute), device_map=device, **kwargs,
    )
    return model.eval()


def vllm_problem(path: str | Path) -> str | None:
    """Why vLLM cannot run this folder as it is, or None. vLLM quantizes in flight with bitsandbytes to
    4-bit NF4 only (its `quantization="bitsandbytes"`); 8-bit and FP4 need pre-quantized checkpoints."""
    desc = descriptor(path)
    if desc is None:
        return None
    cfg = desc["quantization_config"]
    if cfg.get("load_in_4bit") and cfg.get("bnb_4bit_quant_type") == "nf4":
        return None
    scheme = desc.get("scheme") or ("int8" if cfg.get("load_in_8bit") else cfg.get("bnb_4bit_quant_type"))
    return f"vLLM quantizes bitsandbytes in flight to 4-bit NF4 only, not {scheme} (that needs a pre-quantized checkpoint)"


def vllm_args(path: str | Path) -> tuple[str, dict[str, Any]]:
    """(model folder, extra LLM arguments) for vLLM: the base and in-flight bitsandbytes for a load-time variant."""
    desc = descriptor(path)
    if desc is None:
        return str(path), {}
    if (why := vllm_problem(path)) is not None:
        raise LoadTimeError(why)
    return str(desc["base_path"]), {"quantization": "bitsandbytes"}
