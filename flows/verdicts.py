"""What the command line says of a run's verdicts: one row per variant (the verdict first, then the check that
made it) and the lines above the table that qualify every verdict of a model (random weights, a base whose weights
passed through quantization before the run)."""

from __future__ import annotations

import json
from typing import Any

from quantgate.catalog.records import RANDOM_WEIGHTS

# Deciding outcomes that are not a failure or an undecided interval: the table says which.
_NOT_COMPARABLE = {"not_comparable": "not comparable", "anomalous": "anomalous"}


def cell(v: object) -> str:
    if v is None:
        return "NULL"
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (dict, list)):
        return json.dumps(v)
    return str(v)


def verdict_row(row: dict[str, Any]) -> dict[str, Any]:
    """A scorecard row as the end of a run shows it: the verdict first, then the check that made it (its value
    against its threshold; none for an accept; for a not_comparable verdict, why), size and speedup over the base,
    whether the model's weights were random and what the base's were quantized as (the table says those in a line
    above it; csv and json, read by scripts, on every row)."""
    if row["deciding_check"] is None:
        deciding = "every check passed" if row["decision"] == "accept" else row["reason"].split(": ", 1)[-1]
    elif row["deciding_value"] is None:  # a check with no figure of its own, e.g. no informative quality gate
        deciding = row["deciding_check"]
    else:
        deciding = f"{row['deciding_check']} {cell(row['deciding_value'])}"
        if row["deciding_threshold"] is not None:
            deciding += f" vs {cell(row['deciding_threshold'])}"
        if row["items_to_decide"]:
            deciding += f"; ~{row['items_to_decide']:,} items would decide"
    if (why := _NOT_COMPARABLE.get(row.get("deciding_outcome") or "")) is not None:
        deciding += f" ({why})"
    times = lambda x: None if x is None else f"{x:.2f}x"  # noqa: E731
    return {"variant": row["variant"], "decision": row["decision"], "deciding_check": deciding,
            "size": times(row["size_ratio"]), "speedup": times(row["speedup"]),
            "random_weights": bool(row["random_weights"]),
            "base_provenance": row.get("base_provenance") if row.get("base_prequantized") else None}


def model_notes(card: list[dict[str, Any]]) -> list[str]:
    """The lines above a run's verdicts that hold for every one of them."""
    if not card:
        return []
    first, notes = card[0], []
    if first["random_weights"]:
        notes.append(f"{first['model_id']}: {RANDOM_WEIGHTS}; its speed, memory and time are the model's")
    if first.get("base_prequantized"):
        notes.append(f"{first['model_id']}: recoveries are against a {first['base_provenance']} base (its weights"
                     " passed through quantization before this run), not the 16-bit release")
    return notes
