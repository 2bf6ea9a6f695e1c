"""What speed runs read from a checkpoint folder: its config.json, and whether it has layers vLLM runs on a
mixed-precision kernel."""

from __future__ import annotations

import json
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

