"""Whether a checkpoint's weights passed through quantization before quantgate got them (catalog/records.Provenance).

A GGUF file says it three ways, read in this order: its header's `general.file_type` (llama.cpp's name for the
whole file, Q4_K_M), else the type most of its weights are stored in (a file written without the key; a Q4_K_M
file's tensors are Q4_K and Q6_K, so this names the block type, not the mix), else its file name, which by
llama.cpp's convention ends in the type (`…-q4_k_m.gguf`), for a file no longer at hand. A checkpoint's
config.json says it with a `quantization_config` (its `quant_method` and bits); a bitsandbytes one by that method.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from typing import Any

from quantgate.catalog.records import Provenance

# GGUF types that store weights at 16 or 32 bits: a file of these was never quantized.
UNQUANTIZED = frozenset({"F64", "F32", "F16", "BF16"})
# A quant type as llama.cpp names files: Q4_K_M, Q4_1, Q8_0, IQ2_XS, TQ1_0, BF16 (not inside a word: qwen2 is none).
_TYPE_IN_NAME = re.compile(r"(?<![A-Za-z0-9])(I?Q[1-8](?:_[A-Za-z0-9]{1,4}){0,2}|TQ[12]_0|BF16|F16|F32)(?![A-Za-z0-9])",
                           re.IGNORECASE)
CONFIG_EVIDENCE = "config.json quantization_config"


def _bits(quant_type: str) -> int | None:
    """Nominal bits per weight of a GGUF type: its first number (Q4_K_M: 4, IQ2_XS: 2, BF16: 16)."""
    found = re.search(r"\d+", quant_type)
    return int(found.group()) if found else None


def _gguf(quant_type: str, evidence: str) -> Provenance:
    kind = quant_type.upper()
    return Provenance(kind not in UNQUANTIZED, "gguf", kind, _bits(kind), evidence)


def gguf_name_provenance(file: str) -> Provenance | None:
    """The quant type a GGUF's file name says (the last one it names), or None where it names none."""
    found = _TYPE_IN_NAME.findall(Path(file).name.removesuffix(".gguf"))
    return _gguf(found[-1], f"file name {Path(file).name}") if found else None


def gguf_provenance(path: Path) -> Provenance:
    """A GGUF file's quant type from its header (tensor data is not read), else from its name; a file that says
    neither is still a GGUF, quantized by what the format is for, its type unknown."""
    from gguf import GGUFReader, LlamaFileType

    reader = GGUFReader(path)
    field = reader.fields.get("general.file_type")
    if field is not None:
        try:
            ftype = LlamaFileType(int(field.contents()))
        except ValueError:  # a file type newer than this gguf library knows: the tensors still say
            ftype = LlamaFileType.GUESSED
        if ftype != LlamaFileType.GUESSED:
            return _gguf(ftype.name.removeprefix("MOSTLY_").removeprefix("ALL_"), "general.file_type")
    weights: Counter[str] = Counter()
    for t in reader.tensors:
        if len(t.shape) > 1:  # the matrices: norms and biases stay F32 in every quantized file
            weights[t.tensor_type.name] += int(t.n_elements)
    if weights:
        kind, _ = weights.most_common(1)[0]
        mix = ", ".join(f"{name} {n / sum(weights.values()):.0%}" for name, n in weights.most_common())
        return _gguf(kind, f"tensor types ({mix} of the weights)")
    return gguf_name_provenance(path.name) or Provenance(True, "gguf", None, None, "a GGUF file of unknown type")


def _config_bits(q: dict[str, Any], method: str) -> int | None:
    for key in ("bits", "w_bit", "weight_bits"):
        if isinstance(q.get(key), int):
            return q[key]
    groups = q.get("config_groups") or {}
    bits = [g["weights"]["num_bits"] for g in groups.values()
            if isinstance(g, dict) and isinstance(g.get("weights"), dict) and isinstance(g["weights"].get("num_bits"), int)]
    if bits:
        return min(bits)
    return {"fp8": 8, "fbgemm_fp8": 8, "mxfp4": 4}.get(method)


def config_provenance(config: dict[str, Any]) -> Provenance | None:
    """What a checkpoint's config.json says of quantization: None where it has no `quantization_config`."""
    q = config.get("quantization_config")
    if not isinstance(q, dict):
        return None
    method = str(q.get("quant_method") or "unknown").lower()
    if method == "bitsandbytes":
        if q.get("load_in_4bit"):
            return Provenance(True, "bitsandbytes", str(q.get("bnb_4bit_quant_type") or "fp4"), 4, CONFIG_EVIDENCE)
        return Provenance(True, "bitsandbytes", "int8", 8, CONFIG_EVIDENCE)
    return Provenance(True, "quantization_config", method, _config_bits(q, method), CONFIG_EVIDENCE)
