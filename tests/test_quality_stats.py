import math

import numpy as np
import pytest
from lm_eval.api.metrics import bits_per_byte, mean, mean_stderr, weighted_perplexity

from quantgate.tasks.steps.quality_stats import (
    QualityStatsError, aggregation, delta_interval, items_to_decide, paired_bootstrap, z_score,
)


def accuracy_items(n=500, p=0.7, seed=1):
    return (np.random.default_rng(seed).random(n) < p).astype(float)


def test_identical_results_recover_fully_with_a_tight_interval():
    acc = accuracy_items()
    ci = paired_bootstrap(acc, acc, higher_is_better=True)
    assert (ci.recovery, ci.lower, ci.upper) == (1.0, 1.0, 1.0)
    assert (ci.method, ci.n_items, ci.confidence) == ("bootstrap", 500, 0.95)


def test_a_variant_that_loses_items_has_an_interval_below_one_around_the_point():
    base = accuracy_items()
    variant = base.copy()
    variant[np.flatnonzero(base == 1)[:40]] = 0  # 40 right answers turn wrong
    ci = paired_bootstrap(base, variant, higher_is_better=True)
    assert ci.recovery == pytest.approx(mean(variant) / mean(base))
    assert ci.lower < ci.recovery < ci.upper < 1.0
    # Pairing is what makes it tight: the unpaired interval from the two stderrs is more than twice as wide.
    unpaired = delta_interval(mean(base), mean_stderr(base), mean(variant), mean_stderr(variant), higher_is_better=True)
    assert 2 * (ci.upper - ci.lower) < unpaired.upper - unpaired.lower
    # Fixed seed: the same numbers every time; a wider confidence gives a lower lower bound.
    assert paired_bootstrap(base, variant, higher_is_better=True) == ci
    assert paired_bootstrap(base, variant, higher_is_better=True, confidence=0.99).lower < ci.lower


def test_bits_per_byte_is_resampled_by_document_and_matches_lm_eval():
    rng = np.random.default_rng(2)
    nbytes = rng.integers(200, 900, size=40).astype(float)
    base_ll = -nbytes * rng.uniform(0.6, 0.8, size=40)
    variant_ll = base_ll * 1.05 - rng.uniform(0, 2, size=40)  # about 5% more cross-entropy per document
    assert aggregation("bits_per_byte") == "bits_per_byte"
    ci = paired_bootstrap(base_ll, variant_ll, higher_is_better=False, agg="bits_per_byte",
                          base_weights=nbytes, variant_weights=nbytes)
    expected = bits_per_byte(list(zip(base_ll, nbytes))) / bits_per_byte(list(zip(variant_ll, nbytes)))
    assert ci.recovery == pytest.approx(expected)
    assert ci.lower < ci.recovery < ci.upper < 1.0

    # Word perplexity aggregates the same way with word counts: lower is better, recovery = base ÷ variant.
    words = nbytes // 5
    ppl = paired_bootstrap(base_ll, variant_ll, higher_is_better=False, agg=aggregation("word_perplexity"),
                           base_weights=words, variant_weights=words)
    expected = weighted_perplexity(list(zip(base_ll, words))) / weighted_perplexity(list(zip(variant_ll, words)))
    assert ppl.recovery == pytest.approx(expected)
    assert ppl.upper < 1.0


def test_bad_inputs_are_one_line_errors():
    with pytest.raises(QualityStatsError, match="one variant value per base value"):
        paired_bootstrap([1, 0], [1], higher_is_better=True)
    with pytest.raises(QualityStatsError, match="needs a weight"):
        paired_bootstrap([-10.0], [-11.0], higher_is_better=False, agg="bits_per_byte")
    with pytest.raises(QualityStatsError, match="non-finite"):
        paired_bootstrap([-10.0, -12.0], [-11.0, -13.0], higher_is_better=False, agg="bits_per_byte",
                         base_weights=[30, None], variant_weights=[30, 40])


def test_delta_method_fallback_from_reported_stderrs():
    ci = delta_interval(0.60, 0.02, 0.57, 0.02, higher_is_better=True)
    r = 0.57 / 0.60
    se = r * math.hypot(0.02 / 0.60, 0.02 / 0.57)
    assert ci.method == "delta" and ci.n_items is None
    assert (ci.recovery, ci.lower, ci.upper) == pytest.approx((r, r - 1.959964 * se, r + 1.959964 * se))
    inverted = delta_interval(3.0, 0.1, 4.0, 0.1, higher_is_better=False)
    assert inverted.recovery == pytest.approx(0.75)
    assert delta_interval(0.60, None, 0.57, 0.02, higher_is_better=True) is None
    assert delta_interval(0.60, float("nan"), 0.57, 0.02, higher_is_better=True) is None


def test_recovery_se_matches_a_brute_force_simulation_of_fresh_evaluation_sets():
    # Accuracy: 400 items, base right with p 0.7; the variant turns 6% of its right answers wrong and 2% of its
    # wrong ones right. The spread of recovery over 4,000 fresh evaluation sets is what se claims to be.
    rng = np.random.default_rng(3)
    n, sets = 400, 4000
    base = (rng.random((sets, n)) < 0.7).astype(float)
    u = rng.random((sets, n))
    variant = np.where(base == 1, u >= 0.06, u < 0.02).astype(float)
    simulated = (variant.mean(1) / base.mean(1)).std()
    ses = [paired_bootstrap(base[i], variant[i], higher_is_better=True, resamples=200).se for i in range(30)]
    assert np.mean(ses) == pytest.approx(simulated, rel=0.08)

    # bits_per_byte, lower is better: documents of random length, the variant's cross-entropy 4% higher per
    # document with its own noise.
    docs = 60
    nbytes = rng.integers(200, 900, size=(sets, docs)).astype(float)
    base_ll = -nbytes * rng.normal(0.7, 0.08, size=(sets, docs))
    variant_ll = base_ll * rng.normal(1.04, 0.02, size=(sets, docs))
    bpb = lambda ll: -ll.sum(1) / (math.log(2) * nbytes.sum(1))  # noqa: E731
    simulated = (bpb(base_ll) / bpb(variant_ll)).std()
    ses = [paired_bootstrap(base_ll[i], variant_ll[i], higher_is_better=False, agg="bits_per_byte",
                            base_weights=nbytes[i], variant_weights=nbytes[i], resamples=200).se for i in range(30)]
    assert np.mean(ses) == pytest.approx(simulated, rel=0.1)


def test_min_detectable_drop_is_z_times_se_and_items_to_decide_scales_as_one_over_sqrt_n():
    base = accuracy_items(n=300)
    variant = base.copy()
    variant[np.flatnonzero(base == 1)[:8]] = 0
    ci = paired_bootstrap(base, variant, higher_is_better=True)
    assert ci.min_detectable_drop == pytest.approx(1.959964 * ci.se) and z_score(0.95) == pytest.approx(1.959964)
    assert paired_bootstrap(base, variant, higher_is_better=True, confidence=0.99).min_detectable_drop > ci.min_detectable_drop
    unpaired = delta_interval(0.60, 0.02, 0.57, 0.02, higher_is_better=True)
    assert unpaired.min_detectable_drop == pytest.approx((unpaired.upper - unpaired.lower) / 2)
    # Closed form: recovery 0.97, lower side 0.04 on 1,000 items, threshold 0.95: (0.04 / 0.02)^2 = 4x the items.
    assert items_to_decide(1000, 0.97, 0.93, 1.0, 0.95) == 4000
    # Below the threshold the upper side counts: (0.03 / 0.01)^2 = 9x.
    assert items_to_decide(1000, 0.94, 0.90, 0.97, 0.95) == 9000
    assert items_to_decide(1000, 0.95, 0.90, 1.0, 0.95) is None
