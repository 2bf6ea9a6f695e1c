"""The stages of evaluate-model, by the names the warehouse stores them under (`run_stages.stage`) and the live view
and an interrupt's reason show. Every room may import it: flows run the stages, warehouse reads name them. A
`StrEnum`: each member is the string stored, so rows written before it read the same."""

from __future__ import annotations

from enum import StrEnum


class Stage(StrEnum):
    """A stage of a model's run, in the order a run reaches them (build, evaluation, KL and measurements overlap)."""

    DOWNLOAD = "download"  # the model fetched (or found) and stored, its base checkpoint beside it
    QUANTIZE = "quantize"  # a variant built (or reused), one item per variant name
    EVALUATE = "evaluate"  # the suite on a checkpoint, one item per checkpoint uid
    KL = "kl"  # a variant's token-level KL from the base, one item per variant uid
    BENCHMARK = "benchmark"  # a checkpoint's speed rows: measured, reused or taken from one of its format
    PROBE = "probe"  # the base re-measured on its suite's probe, beside the previous run's (engine drift)
    DECIDE = "decide"  # the verdicts, one item ("")


# The stages whose time is not measured: a speed measurement overlapping one of them is not alone on its GPU
# (warehouse/views/92_measurement_windows.sql names the same three; tests/test_stages.py holds them equal).
UNMEASURED = (Stage.QUANTIZE, Stage.EVALUATE, Stage.KL)
