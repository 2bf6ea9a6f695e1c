import math

import pytest

from quantgate.catalog.policy import Policy
from quantgate.tasks.steps.decide import decide

POLICY = Policy.model_validate({
    "version": 1,
    "quality": [{"task": "ppl", "metric": "word_perplexity", "min_recovery": 0.95, "higher_is_better": False}],
    "speed": {"engine": "vllm", "scenario": "thr", "min_speedup": 1.0},
    "max_size_ratio": 0.75,
})
ACC_POLICY = Policy.model_validate({
    "version": 1,
    "quality": [{"task": "qg_piqa", "metric": "acc", "min_recovery": 0.95, "higher_is_better": True}],
    "max_size_ratio": 0.75,
})
VARIANT = {"variant_uid": "v", "status": "built", "error": None, "size_bytes": 30}


def rec(value, stderr=0.001):
    # Lower is better: recovery = base ÷ variant.
    return [{"task": "ppl", "metric": "word_perplexity", "filter": "none", "recovery": value,
             "variant_value": 3.0 / value, "base_value": 3.0, "variant_stderr": stderr, "base_stderr": stderr}]


def speed(status="ok", speedup=1.4, reason=None):
    return [{"engine": "vllm", "scenario": "thr", "status": status, "speedup": speedup, "reason": reason}]


def piqa(base, variant):
    """recovery row, paired per-item rows and flip row of an accuracy task from per-item 0/1 scores."""
    b, v = sum(base) / len(base), sum(variant) / len(variant)
    recovery = [{"task": "qg_piqa", "metric": "acc", "filter": "none", "recovery": v / b, "variant_value": v,
                 "base_value": b, "variant_stderr": None, "base_stderr": None}]
    samples = [{"task": "qg_piqa", "metric": "acc", "filter": "none", "doc_id": i, "base_value": x, "variant_value": y,
                "base_weight": None, "variant_weight": None} for i, (x, y) in enumerate(zip(base, variant))]
    flipped = sum(x != y for x, y in zip(base, variant))
    flips = [{"task": "qg_piqa", "metric": "acc", "filter": "none", "n_items": len(base), "flip_rate": flipped / len(base)}]
    return recovery, samples, flips


def test_accepts_when_every_gate_passes():
    d = decide(VARIANT, 100, rec(0.98), speed(), POLICY)
    assert d.decision == "accept"
    assert d.quality_recovery == pytest.approx(0.98) and d.speedup == pytest.approx(1.4) and d.size_ratio == pytest.approx(0.3)
    assert d.quality_lower_bound is not None and 0.95 <= d.quality_lower_bound < 0.98
    assert "ppl/word_perplexity recovery 0.98 (95% CI [0.9" in d.reason and "]) >= 0.95" in d.reason
    assert "speedup 1.40x >= 1.0x" in d.reason
    assert d.policy_hash == POLICY.hash


def test_rejects_and_names_the_failing_metric_first():
    d = decide(VARIANT, 100, rec(0.40), speed(), POLICY)
    assert d.decision == "reject"
    assert d.reason.startswith("reject: ppl/word_perplexity recovery 0.4 (95% CI [0.39")
    assert "]) < 0.95" in d.reason and d.checks[0].outcome == "fail" and d.checks[0].upper < 0.95


def test_unmeasured_speed_is_said_not_invented_and_size_still_counts():
    d = decide(VARIANT, 100, rec(0.99), speed("skipped", None, "vllm is not installed"), POLICY)
    assert d.decision == "accept" and d.speedup is None
    assert "speed vllm/thr not measured (vllm is not installed)" in d.reason
    big = decide(VARIANT | {"size_bytes": 90}, 100, rec(0.99), [], POLICY)
    assert big.decision == "reject" and big.reason.startswith("reject: size 0.90x base > 0.75x")
    assert "speed vllm/thr not measured (not run)" in big.reason


def test_slower_variant_and_missing_metric_and_failed_build_are_rejected():
    assert decide(VARIANT, 100, rec(0.99), speed(speedup=0.8), POLICY).reason.startswith("reject: speed vllm/thr speedup 0.80x < 1.0x")
    assert decide(VARIANT, 100, [], speed(), POLICY).reason.startswith("reject: ppl/word_perplexity not measured")
    failed = decide(VARIANT | {"status": "failed", "error": "NaN in weights"}, 100, [], [], POLICY)
    assert (failed.decision, failed.reason) == ("reject", "reject: build failed: NaN in weights")


def test_lower_bound_from_paired_items_accepts_only_when_it_clears_the_gate():
    # 2,000 items, base 70% right; the variant flips 10 right answers to wrong: recovery 0.993, tight CI.
    base = [1] * 1400 + [0] * 600
    close = base[:]
    for i in range(10):
        close[i] = 0
    recovery, samples, flips = piqa(base, close)
    d = decide(VARIANT, 100, recovery, [], ACC_POLICY, samples, flips)
    assert d.decision == "accept", d.reason
    assert 0.95 < d.quality_lower_bound < d.quality_recovery < 1
    assert d.flip_rate == pytest.approx(0.005)
    assert d.checks[0].detail["interval"] == "bootstrap" and d.checks[0].items == 2000

    # 60 items: recovery 0.967 clears 0.95, but one item more or less moves it by 3%: the interval spans the
    # threshold, so the data decides neither way.
    small_base = [1] * 30 + [0] * 30
    small_var = [0] + [1] * 29 + [0] * 30
    recovery, samples, flips = piqa(small_base, small_var)
    d = decide(VARIANT, 100, recovery, [], ACC_POLICY, samples, flips)
    assert recovery[0]["recovery"] == pytest.approx(29 / 30)
    assert d.decision == "inconclusive"
    (check,) = [c for c in d.checks if c.kind == "quality"]
    assert check.outcome == "inconclusive" and check.lower < 0.95 <= check.upper
    assert d.reason.startswith(f"inconclusive: qg_piqa/acc recovery 0.9667 (95% CI [{check.lower:.4g}, {check.upper:.4g}])"
                               " spans 0.95 (variant 0.4833 vs base 0.5, 1.7% of 60 items flipped"), d.reason
    assert check.items == 60 and check.items_to_decide > 60
    assert check.items_to_decide == math.ceil(60 * ((29 / 30 - check.lower) / (29 / 30 - 0.95)) ** 2)
    assert d.reason.endswith(f": inconclusive; ~{round(check.items_to_decide, -2):,} items would decide (have 60);"
                             " size 0.30x base <= 0.75x")

    # The same evidence under a point-estimate policy passes, and the interval is still reported.
    lenient = ACC_POLICY.model_copy(update={"use_lower_bound": False})
    d = decide(VARIANT, 100, recovery, [], lenient, samples, flips)
    assert d.decision == "accept" and "qg_piqa/acc recovery 0.9667 >= 0.95" in d.reason and "95% CI " in d.reason


def test_without_items_the_reported_stderrs_bound_recovery_and_without_either_nothing_is_accepted():
    loose = decide(VARIANT, 100, rec(0.98, stderr=0.2), speed(), POLICY)
    assert loose.decision == "inconclusive" and loose.checks[0].detail["interval"] == "delta"
    assert loose.quality_lower_bound < 0.95 < loose.checks[0].upper
    # No interval at all: neither bound is known, so the check is not decided (and never accepted).
    unknown = decide(VARIANT, 100, rec(0.98, stderr=None), speed(), POLICY)
    assert unknown.decision == "inconclusive" and unknown.quality_lower_bound is None
    assert ("recovery 0.98 without a confidence interval (no per-item results or stderr): inconclusive"
            in unknown.reason) and unknown.checks[0].items_to_decide is None


def test_an_optional_long_context_gate_is_noted_where_unmeasurable_and_gates_where_measured():
    policy = Policy.model_validate({**POLICY.model_dump(), "quality": [
        *[g.model_dump() for g in POLICY.quality],
        {"task": "qg_passkey", "metric": "exact_match", "min_recovery": 0.9, "higher_is_better": True,
         "required": False}]})
    absent = decide(VARIANT, 100, rec(0.98), speed(), policy)
    assert absent.decision == "accept" and "qg_passkey/exact_match not measured (optional gate)" in absent.reason
    # The base retrieves nothing: there is no ratio to gate on.
    zero = [{"task": "qg_passkey", "metric": "exact_match", "filter": "first-number", "recovery": None,
             "variant_value": 0.0, "base_value": 0.0, "variant_stderr": 0.0, "base_stderr": 0.0}]
    none = decide(VARIANT, 100, rec(0.98) + zero, speed(), policy)
    assert none.decision == "accept" and "has no recovery (base 0.0, variant 0.0) (optional gate)" in none.reason
    # Measured: it gates like any other (20 items per side, the variant finds half of what the base finds).
    base, variant = [1] * 16 + [0] * 4, [1] * 8 + [0] * 12
    lost = [{"task": "qg_passkey", "metric": "exact_match", "filter": "first-number", "recovery": 0.5,
             "variant_value": 0.4, "base_value": 0.8, "variant_stderr": None, "base_stderr": None}]
    samples = [{"task": "qg_passkey", "metric": "exact_match", "filter": "first-number", "doc_id": i,
                "base_value": x, "variant_value": y, "base_weight": None, "variant_weight": None}
               for i, (x, y) in enumerate(zip(base, variant))]
    rejected = decide(VARIANT, 100, rec(0.98) + lost, speed(), policy, samples)
    assert rejected.decision == "reject" and rejected.reason.startswith("reject: qg_passkey/exact_match recovery 0.5")


SERVING_POLICY = Policy.model_validate({
    "version": 1,
    "quality": [{"task": "ppl", "metric": "word_perplexity", "min_recovery": 0.95, "higher_is_better": False}],
    "serving": {"scenario": "srv", "min_goodput_ratio": 0.95},
    "max_size_ratio": 0.75,
})


def serving(goodput=24.0, base=16.0, point="kernel=MarlinLinearKernel", status="ok", reason=None):
    ratio = None if goodput is None or not base else goodput / base
    return [{"scenario": "srv", "status": status, "reason": reason, "point": point,
             "settings": {"kernel": "MarlinLinearKernel"}, "load": "c=32", "goodput_requests_per_s": goodput,
             "base_goodput_requests_per_s": base, "base_point": "default", "goodput_ratio": ratio}]


def test_the_serving_gate_judges_the_tuned_config_and_keeps_it_in_the_checks():
    d = decide(VARIANT, 100, rec(0.98), [], SERVING_POLICY, serving=serving())
    assert d.decision == "accept"
    (check,) = [c for c in d.checks if c.name == "serving srv"]
    assert (check.kind, check.outcome) == ("serving", "pass") and check.value == pytest.approx(1.5)
    assert check.detail["point"] == "kernel=MarlinLinearKernel"
    assert check.detail["settings"] == {"kernel": "MarlinLinearKernel"} and check.detail["load"] == "c=32"
    assert ("serving srv goodput at the SLO 1.50x base >= 0.95x (24 req/s at c=32, tuned config"
            " kernel=MarlinLinearKernel; base 16 req/s (default))") in d.reason

    slow = decide(VARIANT, 100, rec(0.98), [], SERVING_POLICY, serving=serving(goodput=12.0, point="default"))
    assert slow.reason.startswith("reject: serving srv goodput at the SLO 0.75x base < 0.95x (12 req/s at c=32,"
                                  " vLLM's defaults;")


def test_unmeasured_serving_is_noted_and_a_base_without_goodput_is_no_bar():
    skipped = decide(VARIANT, 100, rec(0.98), [], SERVING_POLICY,
                     serving=serving(goodput=None, status="skipped", reason="vllm is not installed"))
    assert skipped.decision == "accept" and "serving srv not measured (vllm is not installed)" in skipped.reason
    assert "serving srv not measured (not run)" in decide(VARIANT, 100, rec(0.98), [], SERVING_POLICY).reason
    beats = decide(VARIANT, 100, rec(0.98), [], SERVING_POLICY, serving=serving(goodput=3.0, base=0.0))
    assert beats.decision == "accept" and "the base meets it on no load" in beats.reason
    neither = decide(VARIANT, 100, rec(0.98), [], SERVING_POLICY, serving=serving(goodput=0.0, base=0.0))
    assert [c.outcome for c in neither.checks if c.name == "serving srv"] == ["not_measured"]


def loses(base, k):
    """The first k right answers of `base` turned wrong."""
    out, lost = list(base), 0
    for i, x in enumerate(out):
        if x == 1 and lost < k:
            out[i], lost = 0, lost + 1
    return out


def test_three_verdicts_from_the_interval_against_the_threshold():
    base = [1, 0, 1, 1, 0, 1, 1, 0, 1, 1] * 20  # 200 items, 140 right
    verdicts = {}
    for lost in (0, 5, 40):
        recovery, samples, flips = piqa(base, loses(base, lost))
        d = decide(VARIANT, 100, recovery, [], ACC_POLICY, samples, flips)
        (check,) = [c for c in d.checks if c.kind == "quality"]
        verdicts[lost] = (d.decision, check.outcome)
        assert check.value == pytest.approx((140 - lost) / 140) and check.threshold == 0.95 and check.items == 200
        if check.outcome == "inconclusive":
            assert check.lower < 0.95 <= check.upper and check.items_to_decide > 200
        else:
            assert check.items_to_decide is None
            assert check.lower >= 0.95 if check.outcome == "pass" else check.upper < 0.95
    # Lossless: the interval is [1, 1]. 5 of 140 lost (0.964): spans 0.95. 40 lost (0.714): wholly below.
    assert verdicts == {0: ("accept", "pass"), 5: ("inconclusive", "inconclusive"), 40: ("reject", "fail")}

    # On the point estimate the same evidence is decided: no inconclusive.
    lenient = ACC_POLICY.model_copy(update={"use_lower_bound": False})
    recovery, samples, flips = piqa(base, loses(base, 5))
    assert decide(VARIANT, 100, recovery, [], lenient, samples, flips).decision == "accept"


def test_a_failure_outranks_an_inconclusive_check_and_the_reason_orders_them():
    base = [1, 0, 1, 1, 0, 1, 1, 0, 1, 1] * 20
    recovery, samples, flips = piqa(base, loses(base, 5))
    policy = Policy.model_validate({**ACC_POLICY.model_dump(), "quality": [
        {"task": "ppl", "metric": "word_perplexity", "min_recovery": 0.95, "higher_is_better": False},
        *[g.model_dump() for g in ACC_POLICY.quality]]})
    both = recovery + rec(0.99)
    d = decide(VARIANT, 100, both, [], policy, samples, flips)
    assert d.decision == "inconclusive"
    assert [c.outcome for c in d.checks] == ["pass", "inconclusive", "pass"]  # policy order: ppl, piqa, size
    assert d.reason.startswith("inconclusive: qg_piqa/acc") and d.reason.index("ppl/word_perplexity") < d.reason.index("size")
    big = decide(VARIANT | {"size_bytes": 90}, 100, both, [], policy, samples, flips)
    assert big.decision == "reject"
    notes = big.reason.removeprefix("reject: ").split("; ")
    assert notes[0].startswith("size 0.90x base > 0.75x") and notes[1].startswith("qg_piqa/acc recovery 0.9643")
    assert notes[-1].startswith("ppl/word_perplexity recovery 0.99")


def test_items_to_decide_is_where_the_same_spread_stops_spanning_the_threshold():
    # Tiling the same items m times keeps their paired spread and shrinks the interval like 1/sqrt(m):
    # below the predicted count the check stays inconclusive, above it the check passes.
    base = [1, 0, 1, 1, 0, 1, 1, 0, 1, 1] * 20
    variant = loses(base, 5)
    recovery, samples, flips = piqa(base, variant)
    (check,) = [c for c in decide(VARIANT, 100, recovery, [], ACC_POLICY, samples, flips).checks if c.kind == "quality"]
    ratio = check.items_to_decide / 200
    assert 3 < ratio < 8

    def outcome(tiles):
        recovery, samples, flips = piqa(base * tiles, variant * tiles)
        return next(c for c in decide(VARIANT, 100, recovery, [], ACC_POLICY, samples, flips).checks
                    if c.kind == "quality").outcome

    assert outcome(math.floor(ratio * 0.8)) == "inconclusive"
    assert outcome(math.ceil(ratio * 1.2)) == "pass"


def test_min_detectable_drop_is_the_interval_half_width_and_shrinks_with_items():
    base = [1, 0, 1, 1, 0, 1, 1, 0, 1, 1] * 20
    variant = loses(base, 5)
    drops = []
    for tiles in (1, 4):
        recovery, samples, flips = piqa(base * tiles, variant * tiles)
        (check,) = [c for c in decide(VARIANT, 100, recovery, [], ACC_POLICY, samples, flips).checks if c.kind == "quality"]
        assert check.min_detectable_drop == pytest.approx((check.upper - check.lower) / 2, rel=0.25)
        drops.append(check.min_detectable_drop)
    assert drops[1] == pytest.approx(drops[0] / 2, rel=0.01)  # 4x the items, half the drop


def test_a_gate_with_a_filter_judges_that_filter_of_the_metric():
    """GSM8K reports exact match twice (strict-match: the '#### N' line; flexible-extract: any last number): a
    gate naming strict-match judges that one, whatever order the rows come in."""
    def row(filter_, recovery):
        return {"task": "gsm", "metric": "exact_match", "filter": filter_, "recovery": recovery, "variant_value": 0.6 * recovery,
                "base_value": 0.6, "variant_stderr": 0.001, "base_stderr": 0.001}

    policy = Policy.model_validate({"version": 1, "max_size_ratio": 0.75, "quality": [
        {"task": "gsm", "metric": "exact_match", "filter": "strict-match", "min_recovery": 0.95, "higher_is_better": True}]})
    rows = [row("flexible-extract", 1.0), row("strict-match", 0.5)]
    d = decide(VARIANT, 100, rows, [], policy)
    assert d.decision == "reject" and d.checks[0].detail["filter"] == "strict-match"
    assert decide(VARIANT, 100, rows[::-1], [], policy).checks[0].value == pytest.approx(0.5)


def passes(speedup, low, high, n=3, base_n=3):
    return [{"engine": "vllm", "scenario": "thr", "status": "ok", "speedup": speedup, "reason": None,
             "speedup_low": low, "speedup_high": high, "passes": n, "base_passes": base_n}]


def test_speed_is_judged_on_its_passes_range_and_is_inconclusive_where_it_spans_the_threshold():
    # reference5's FP8 (1.02x; passes 0.97-1.03x), GPTQ (0.90x; 0.885-0.927x), and a variant clear of 1.0x.
    spans = decide(VARIANT, 100, rec(0.99), passes(1.02, 0.969, 1.026), POLICY)
    assert spans.decision == "inconclusive"
    (check,) = [c for c in spans.checks if c.kind == "speed"]
    assert check.outcome == "inconclusive" and (check.lower, check.upper) == (0.969, 1.026)
    assert ("speed vllm/thr speedup 1.02x (every pairing of its 3 passes with the base's 3: 0.97-1.03x) spans 1.0x:"
            " inconclusive") in spans.reason
    slower = decide(VARIANT, 100, rec(0.99), passes(0.90, 0.885, 0.927), POLICY)
    assert slower.decision == "reject" and "0.89-0.93x) < 1.0x" in slower.reason
    faster = decide(VARIANT, 100, rec(0.99), passes(1.3, 1.2, 1.4), POLICY)
    assert faster.decision == "accept" and "1.20-1.40x) >= 1.0x" in faster.reason
    # One pass on either side is no range: the ratio of the two figures decides, as before.
    one = decide(VARIANT, 100, rec(0.99), passes(1.02, 1.02, 1.02, n=1), POLICY)
    assert one.decision == "accept" and "speedup 1.02x >= 1.0x" in one.reason


def test_a_speed_ratio_the_host_paced_decides_nothing_unless_the_policy_lets_it():
    # reference9's GPTQ over base on the H200: both sides' engine core on a CPU ~97% of each pass, decode steps 5x
    # the weights' memory floor; the same build measured 0.84x there and 0.86x on another H200 host, FP8 1.00x and
    # 0.74x. The ratio is the host's as much as the build's: by default it is uninformative, as a gate at chance.
    rows = [{**passes(0.84, 0.79, 0.88)[0], "host_bound": True, "host_busy_share": 0.97}]
    d = decide(VARIANT, 100, rec(0.99), rows, POLICY)
    (check,) = [c for c in d.checks if c.kind == "speed"]
    assert d.decision == "accept" and check.outcome == "uninformative" and check.detail["host_bound"] is True
    assert ("0.79-0.88x) uninformative for 1.0x; host-bound (the engine's busiest process on a CPU 97% of a pass,"
            " decode steps 3x or more its weights' memory floor): this ratio moves with the host and decides nothing"
            " (policy speed.host_bound: decide lets it)") in d.reason
    deciding = Policy.model_validate({**POLICY.model_dump(), "speed": {**POLICY.speed.model_dump(), "host_bound": "decide"}})
    d = decide(VARIANT, 100, rec(0.99), rows, deciding)
    assert d.decision == "reject" and ("0.79-0.88x) < 1.0x; host-bound (the engine's busiest process on a CPU 97% of"
                                       " a pass, decode steps 3x or more its weights' memory floor): this ratio moves"
                                       " with the host") in d.reason
    paced_by_gpu = decide(VARIANT, 100, rec(0.99), [{**rows[0], "host_bound": False}], POLICY)
    assert paced_by_gpu.decision == "reject" and "host-bound" not in paced_by_gpu.reason
    assert [c for c in paced_by_gpu.checks if c.kind == "speed"][0].detail["host_bound"] is False


def test_paired_passes_are_named_in_the_reason():
    rows = [{**passes(1.02, 1.01, 1.04)[0], "paired": True}]
    d = decide(VARIANT, 100, rec(0.99), rows, POLICY)
    (check,) = [c for c in d.checks if c.kind == "speed"]
    assert check.outcome == "pass" and check.detail["paired"] is True
    assert "speed vllm/thr speedup 1.02x (its 3 passes, each beside a base pass: 1.01-1.04x) >= 1.0x" in d.reason


def test_a_host_bound_serving_ratio_decides_nothing_unless_the_policy_lets_it():
    paced = [{**serving(goodput=12.0, point="default")[0], "host_bound": True}]
    d = decide(VARIANT, 100, rec(0.98), [], SERVING_POLICY, serving=paced)
    (check,) = [c for c in d.checks if c.kind == "serving"]
    assert d.decision == "accept" and check.outcome == "uninformative" and check.detail["host_bound"] is True
    assert "serving srv goodput at the SLO 0.75x base (12 req/s at c=32, vLLM's defaults; base 16 req/s" in d.reason
    assert "uninformative for 0.95x: host-bound" in d.reason
    deciding = Policy.model_validate({**SERVING_POLICY.model_dump(),
                                      "serving": {**SERVING_POLICY.serving.model_dump(), "host_bound": "decide"}})
    assert decide(VARIANT, 100, rec(0.98), [], deciding, serving=paced).decision == "reject"


def with_chance(rows, chance):
    """Rows of variant_recovery as the view gives them for a task with a chance level."""
    return [{**r, "chance": chance,
             "recovery_above_chance": (r["variant_value"] - chance) / (r["base_value"] - chance)} for r in rows]


def test_a_gate_whose_base_is_at_chance_is_uninformative_and_never_decides():
    # 2-choice items, base right on 52 of 100: not clearly above 0.5, so the ratio says nothing of the build.
    base = [1] * 52 + [0] * 48
    variant = [1] * 40 + [0] * 60
    recovery, samples, flips = piqa(base, variant)
    d = decide(VARIANT, 100, with_chance(recovery, 0.5), [], ACC_POLICY, samples, flips)
    piqa_check = next(c for c in d.checks if c.name == "qg_piqa/acc")
    assert piqa_check.outcome == "uninformative" and piqa_check.value is None
    assert "qg_piqa/acc uninformative: base 0.52 vs chance 0.5" in piqa_check.note
    assert "qg_piqa cannot measure this model" in piqa_check.note
    assert piqa_check.detail["base_margin"] == pytest.approx(0.02) and piqa_check.detail["base_margin_lower"] < 0
    # With no informative quality gate left, the verdict is inconclusive and says why; a failed size still rejects.
    assert d.decision == "inconclusive"
    assert d.checks[-2].name == "no informative quality gate" and d.checks[-2].outcome == "inconclusive"
    assert "no informative quality gate (qg_piqa/acc at chance for the base)" in d.reason
    assert decide({**VARIANT, "size_bytes": 90}, 100, with_chance(recovery, 0.5), [], ACC_POLICY, samples,
                  flips).decision == "reject"


def test_a_base_clearly_above_chance_is_judged_as_before():
    base = [1] * 80 + [0] * 20
    variant = [1] * 79 + [0] * 21
    recovery, samples, flips = piqa(base, variant)
    plain = decide(VARIANT, 100, recovery, [], ACC_POLICY, samples, flips)
    informed = decide(VARIANT, 100, with_chance(recovery, 0.5), [], ACC_POLICY, samples, flips)
    assert informed.checks[0].outcome == plain.checks[0].outcome != "uninformative"
    assert informed.checks[0].value == pytest.approx(plain.checks[0].value)
    assert informed.checks[0].detail["base_margin"] == pytest.approx(0.3)


def test_only_informative_gates_decide_when_some_are_at_chance():
    policy = Policy.model_validate({**ACC_POLICY.model_dump(), "quality": [
        ACC_POLICY.quality[0].model_dump(),
        {"task": "ppl", "metric": "word_perplexity", "min_recovery": 0.95, "higher_is_better": False}]})
    recovery, samples, flips = piqa([1] * 51 + [0] * 49, [1] * 51 + [0] * 49)
    d = decide(VARIANT, 100, with_chance(recovery, 0.5) + rec(0.40), [], policy, samples, flips)
    assert d.decision == "reject" and d.checks[0].outcome == "uninformative"
    assert "no informative quality gate" not in d.reason
    assert d.quality_recovery == pytest.approx(0.40)  # the uninformative ratio (1.0) is not the quality figure


def test_recovery_above_chance_reads_a_multiple_choice_loss_at_its_size():
    # 4 choices, base 0.40, variant 0.35: plain 0.875, above chance (0.35 - 0.25) / (0.40 - 0.25) = 0.667.
    base = [1] * 400 + [0] * 600
    variant = [1] * 350 + [0] * 650
    recovery, samples, flips = piqa(base, variant)
    gates = [{**ACC_POLICY.quality[0].model_dump(), "min_recovery": 0.8, "recovery": basis}
             for basis in ("plain", "above_chance")]
    plain, above = (decide(VARIANT, 100, with_chance(recovery, 0.25), [],
                           Policy.model_validate({**ACC_POLICY.model_dump(), "quality": [g]}), samples, flips)
                    for g in gates)
    assert plain.checks[0].value == pytest.approx(0.875) and plain.checks[0].outcome == "pass"
    assert above.checks[0].value == pytest.approx(2 / 3) and above.checks[0].outcome == "fail"
    assert above.checks[0].upper < 0.8 < plain.checks[0].lower
    assert "qg_piqa/acc recovery above chance 0.6667" in above.reason and "chance 0.25" in above.reason
    assert above.checks[0].detail["recovery_basis"] == "above_chance"
