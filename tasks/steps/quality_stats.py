"""How sure is a recovery figure: paired bootstrap over per-item results, or the delta method over stderrs.

Every lm-eval metric we gate is a function of two sums over documents, f(Σvalue / Σweight):
mean metrics (acc) have weight 1 and f the identity; bits_per_byte has value = loglikelihood,
weight = bytes and f(x) = -x / ln 2; word/byte perplexity f(x) = exp(-x) with words or bytes as
weight; `perplexity` (loglikelihood tasks) exp(-mean ll). Resampling documents and recomputing
both sums on each side gives the paired bootstrap of recovery for all of them alike.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any, Literal

import numpy as np

from quantgate.catalog.errors import QuantgateError

Aggregation = Literal["mean", "bits_per_byte", "weighted_perplexity", "perplexity"]
RESAMPLES = 2000
SEED = 0
# Resamples drawn per batch: keeps the index matrix near 4M entries whatever the task size.
_BATCH_ENTRIES = 4_000_000


class QualityStatsError(QuantgateError, RuntimeError):
    """Per-item results that cannot be paired or aggregated; the message is one line."""


@dataclass(frozen=True)
class RecoveryInterval:
    recovery: float | None
    lower: float | None
    upper: float | None
    confidence: float
    method: Literal["bootstrap", "delta"]
    n_items: int | None = None
    # Standard error of recovery: linearised over the paired items (bootstrap), or the delta method's.
    se: float | None = None

    @property
    def min_detectable_drop(self) -> float | None:
        """The interval's half-width, z·se: a variant whose true recovery is 1 − this has an interval that
        excludes 1 about half the time; smaller losses are not told apart from none on these items. Read against
        1 − threshold: when it is larger, not even a lossless variant can pass. Taken from the paired spread the verdict itself uses, not from the base's variance and an assumed
        flip rate, which would differ from the spread each quantization method actually produces."""
        return None if self.se is None else z_score(self.confidence) * self.se


def aggregation(metric: str) -> Aggregation:
    """How lm-eval aggregates a metric's per-document values (task configs name the metric after it)."""
    if metric == "bits_per_byte":
        return "bits_per_byte"
    if metric in ("word_perplexity", "byte_perplexity"):
        return "weighted_perplexity"
    if metric == "perplexity":
        return "perplexity"
    return "mean"


def _finish(agg: Aggregation, ratio: np.ndarray) -> np.ndarray:
    if agg == "bits_per_byte":
        return -ratio / math.log(2)
    if agg in ("weighted_perplexity", "perplexity"):
        return np.exp(-ratio)
    return ratio


def aggregate(agg: Aggregation, values: Sequence[float], weights: Sequence[float] | None = None) -> float:
    """The score lm-eval reports from per-document values: f(Σvalue / Σweight), weights 1 for a mean."""
    v = np.asarray(values, dtype=float)
    w = np.ones(len(v)) if weights is None or agg in ("mean", "perplexity") else np.asarray(weights, dtype=float)
    return float(_finish(agg, np.asarray(v.sum() / w.sum())))


def z_score(confidence: float) -> float:
    """The normal quantile of a two-sided interval at `confidence`."""
    return NormalDist().inv_cdf(1 - (1 - confidence) / 2)


def _slope(agg: Aggregation, ratio: float) -> float:
    """d f(R) / dR of `_finish`."""
    if agg == "bits_per_byte":
        return -1 / math.log(2)
    if agg in ("weighted_perplexity", "perplexity"):
        return -math.exp(-ratio)
    return 1.0


def _linearised_se(agg: Aggregation, higher_is_better: bool, bv: np.ndarray, bw: np.ndarray, vv: np.ndarray,
                   vw: np.ndarray, chance: float = 0.0) -> float | None:
    """se of recovery = g(f(R_base), f(R_variant)) from each document's influence on both ratios, paired:
    a document that both sides get wrong moves neither ratio's difference, which is what pairing buys."""
    n = len(bv)
    rb, rv = bv.sum() / bw.sum(), vv.sum() / vw.sum()
    fb, fv = float(_finish(agg, np.asarray(rb))) - chance, float(_finish(agg, np.asarray(rv))) - chance
    num, den = (fv, fb) if higher_is_better else (fb, fv)
    if n < 2 or den == 0:
        return None
    d_num, d_den = 1 / den, -num / den**2
    d_fb, d_fv = (d_den, d_num) if higher_is_better else (d_num, d_den)
    influence = (d_fb * _slope(agg, rb) * (bv - rb * bw) / bw.sum()
                 + d_fv * _slope(agg, rv) * (vv - rv * vw) / vw.sum())
    return _opt(math.sqrt(float((influence**2).sum()) * n / (n - 1)))


def items_to_decide(n_items: int, recovery: float, lower: float, upper: float, threshold: float) -> int | None:
    """Items at which an interval that spans `threshold` would stop spanning it, with the same paired spread:
    the side of the interval facing the threshold shrinks like 1/√n until it equals |recovery − threshold|.
    None where the recovery sits on the threshold (no number of items decides it)."""
    gap = abs(recovery - threshold)
    side = recovery - lower if recovery >= threshold else upper - recovery
    if gap == 0:
        return None
    return math.ceil(n_items * (side / gap) ** 2)


def _recovery(base: np.ndarray, variant: np.ndarray, higher_is_better: bool) -> np.ndarray:
    num, den = (variant, base) if higher_is_better else (base, variant)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(den != 0, num / np.where(den != 0, den, 1), np.nan)


def paired_bootstrap(
    base_values: Sequence[float],
    variant_values: Sequence[float],
    *,
    higher_is_better: bool,
    agg: Aggregation = "mean",
    base_weights: Sequence[float] | None = None,
    variant_weights: Sequence[float] | None = None,
    confidence: float = 0.95,
    resamples: int = RESAMPLES,
    seed: int = SEED,
    chance: float = 0.0,
) -> RecoveryInterval:
    """Recovery (variant ÷ base, inverted when lower is better) and its percentile bootstrap interval; with
    `chance`, recovery above chance, (variant − chance) ÷ (base − chance).

    Item i of each sequence is the same document; documents are resampled with replacement, pairs kept.
    """
    bv, vv = np.asarray(base_values, dtype=float), np.asarray(variant_values, dtype=float)
    n = len(bv)
    if len(vv) != n:
        raise QualityStatsError(f"paired bootstrap needs one variant value per base value, got {len(vv)} and {n}")
    if n == 0:
        raise QualityStatsError("paired bootstrap needs at least one item")
    weighted = agg in ("bits_per_byte", "weighted_perplexity")
    if weighted and (base_weights is None or variant_weights is None):
        raise QualityStatsError(f"{agg} needs a weight (bytes or words) per document")
    bw = np.asarray(base_weights, dtype=float) if weighted else np.ones(n)
    vw = np.asarray(variant_weights, dtype=float) if weighted else np.ones(n)
    if not np.isfinite(np.concatenate([bv, vv, bw, vw])).all():
        raise QualityStatsError("paired bootstrap got a missing or non-finite per-item value")

    point = _recovery(_finish(agg, np.asarray(bv.sum() / bw.sum())) - chance,
                      _finish(agg, np.asarray(vv.sum() / vw.sum())) - chance, higher_is_better)
    rng = np.random.default_rng(seed)
    batch = max(1, _BATCH_ENTRIES // n)
    draws = []
    for start in range(0, resamples, batch):
        idx = rng.integers(0, n, size=(min(batch, resamples - start), n))
        b = _finish(agg, bv[idx].sum(axis=1) / bw[idx].sum(axis=1)) - chance
        v = _finish(agg, vv[idx].sum(axis=1) / vw[idx].sum(axis=1)) - chance
        draws.append(_recovery(b, v, higher_is_better))
    dist = np.concatenate(draws)
    tail = (1 - confidence) / 2
    lower, upper = (np.nanquantile(dist, [tail, 1 - tail]) if np.isfinite(dist).any() else (np.nan, np.nan))
    se = _linearised_se(agg, higher_is_better, bv, bw, vv, vw, chance)
    return RecoveryInterval(_opt(point), _opt(lower), _opt(upper), confidence, "bootstrap", n, se)


def sample_interval(
    items: Sequence[dict[str, Any]], metric: str, *, higher_is_better: bool, confidence: float = 0.95,
    chance: float = 0.0,
) -> RecoveryInterval:
    """Bootstrap interval from rows of the `variant_paired_samples` view (one per document of one metric)."""
    return paired_bootstrap(
        [r["base_value"] for r in items], [r["variant_value"] for r in items],
        higher_is_better=higher_is_better, agg=aggregation(metric),
        base_weights=[r["base_weight"] for r in items], variant_weights=[r["variant_weight"] for r in items],
        confidence=confidence, chance=chance,
    )


def delta_interval(
    base_value: float | None,
    base_stderr: float | None,
    variant_value: float | None,
    variant_stderr: float | None,
    *,
    higher_is_better: bool,
    confidence: float = 0.95,
    chance: float = 0.0,
) -> RecoveryInterval | None:
    """Normal interval of the recovery ratio from the two reported stderrs, None when one is missing; with
    `chance`, of recovery above chance.

    Treats base and variant as independent, which overstates the spread of paired runs (conservative).
    """
    values = (base_value, base_stderr, variant_value, variant_stderr)
    if any(x is None or not math.isfinite(x) for x in values):
        return None
    base_value, variant_value = base_value - chance, variant_value - chance
    if not base_value or not variant_value:
        return None
    num, den = (variant_value, base_value) if higher_is_better else (base_value, variant_value)
    r = float(num / den)
    se = abs(r) * math.hypot(base_stderr / base_value, variant_stderr / variant_value)
    z = z_score(confidence)
    return RecoveryInterval(r, r - z * se, r + z * se, confidence, "delta", se=se)


def _opt(x: float | np.ndarray) -> float | None:
    x = float(x)
    return x if math.isfinite(x) else None
