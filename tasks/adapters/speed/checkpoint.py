"""What speed runs read from a checkpoint folder: its config.json, whether it has layers vLLM runs on a
mixed-precision kernel, and its format (what its speed depends on)."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from typing import Any


def checkpoint_config(model_path: str | Path) -> dict[str, Any] | None:
    """A checkpoint's config.json, or None when it cannot be read."""
    try:
        return json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None


def text_config(model_path: str | Path) -> dict[str, Any] | None:
    """The language model's part of a checkpoint's config (a multimodal one's text_config)."""
    config = checkpoint_config(model_path)
    return None if config is None else config.get("text_config", config)


def safetensors_headers(model_path: str | Path) -> dict[str, dict[str, Any]]:
    """Name -> header entry (dtype, shape, data_offsets) of every tensor in the folder's safetensors files, read
    from their headers alone; empty for a folder without weight files."""
    out: dict[str, dict[str, Any]] = {}
    for file in sorted(Path(model_path).glob("*.safetensors")):
        with file.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            out.update((name, info) for name, info in json.loads(f.read(size)).items() if name != "__metadata__")
    return out


def has_weight_only_int_layers(model_path: str | Path) -> bool | None:
    """Whether the checkpoint has weight-only integer layers (W4A16, W8A16: GPTQ, AWQ, compressed-tensors
    WNA16), the only layers vLLM runs on a mixed-precision kernel; None when its config.json cannot be read."""
    if (config := checkpoint_config(model_path)) is None:
        return None
    quant = config.get("quantization_config") or {}
    method = quant.get("quant_method")
    if method in ("gptq", "awq", "gptq_marlin", "awq_marlin", "marlin"):
        return True
    if method == "compressed-tensors":
        return any((g.get("weights") or {}).get("type") == "int" and not g.get("input_activations")
                   for g in (quant.get("config_groups") or {}).values())
    return False


def is_compressed_tensors(model_path: str | Path) -> bool:
    """Whether the checkpoint is stored in compressed-tensors (llm-compressor's AWQ, GPTQ, INT8 and FP8 builds),
    which Transformers decompresses to 16 bits as it loads it."""
    config = checkpoint_config(model_path) or {}
    return (config.get("quantization_config") or {}).get("quant_method") == "compressed-tensors"


# Fields of a compressed-tensors quantization config that say how a build was calibrated, not what the engine
# runs: observers pick scales before they are stored; activation ordering "weight" (alias "static") quantizes in
# activation order but stores the ordinary layout (compressed-tensors' ActivationOrdering: "doesn't change the
# quantization format"). "group" stores a g_idx tensor and runs another kernel path, so it stays.
_CALIBRATION_ONLY = ("observer", "observer_kwargs")
_PLAIN_ACTORDER = (None, "weight", "static")
# Files that describe the checkpoint to an engine; the weights count by name, dtype and shape only.
_DESCRIPTION_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")


def speed_format(model_path: str | Path) -> str | None:
    """A digest of what a checkpoint's speed depends on, which is its format, not its values: the files that
    describe it to an engine (config with its quantization config, generation defaults, tokenizer) and each
    tensor's name, dtype and shape. Two checkpoints with the same format run the same kernels on the same
    shapes for the same token counts, so one's speed rows stand for the other's (as random weights of a real
    shape stand for trained ones). None when the folder has no safetensors to read (a load-time variant, a
    dummy checkpoint): such a checkpoint is its own format."""
    folder = Path(model_path)
    tensors = safetensors_headers(folder)
    if not tensors:
        return None
    digest = hashlib.sha256()
    for name in _DESCRIPTION_FILES:
        path = folder / name
        if not path.is_file():
            continue
        try:
            content: Any = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        if name == "config.json":
            content = _engine_config(content)
        digest.update(f"{name}\0{json.dumps(content, sort_keys=True)}\n".encode())
    for tensor, info in sorted(tensors.items()):
        digest.update(f"{tensor}\0{info['dtype']}\0{info['shape']}\n".encode())
    return digest.hexdigest()[:16]


def _engine_config(config: dict[str, Any]) -> dict[str, Any]:
    """config.json as an engine reads it: without the paths and versions of who wrote it, and without the
    quantization config's calibration-only fields."""
    out = {k: v for k, v in config.items() if k not in ("_name_or_path", "transformers_version")}
    quant = out.get("quantization_config")
    if isinstance(quant, dict) and isinstance(quant.get("config_groups"), dict):
        groups = {}
        for name, group in quant["config_groups"].items():
            group = dict(group)
            for part in ("weights", "input_activations", "output_activations"):
                if isinstance(group.get(part), dict):
                    args = {k: v for k, v in group[part].items() if k not in _CALIBRATION_ONLY}
                    if args.get("actorder") in _PLAIN_ACTORDER:
                        args["actorder"] = None
                    group[part] = args
            groups[name] = group
        out["quantization_config"] = {**quant, "config_groups": groups}
    return out
