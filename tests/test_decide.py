import pytest

from quantgate.catalog.schema import Policy
from quantgate.tasks.decide import decide

POLICY = Policy.model_validate({
    "version": 1,
    "quality": [{"task": "ppl", "metric": "word_perplexity", "min_recovery": 0.95, "higher_is_better": False}],
    "speed": {"engine": "vllm", "scenario": "thr", "min_speedup": 1.0},
    "max_size_ratio": 0.75,
})
VARIANT = {"variant_uid": "v", "status": "built", "error": None, "size_bytes": 30}


def rec(value):
    return [{"task": "ppl", "metric": "word_perplexity", "filter": "none", "recovery": value, "variant_value": 3.0 / value, "base_value": 3.0}]


def speed(status="ok", speedup=1.4, reason=None):
    return [{"engine": "vllm", "scenario": "thr", "status": status, "speedup": speedup, "reason": reason}]


def test_accepts_when_every_gate_passes():
    d = decide(VARIANT, 100, rec(0.98), speed(), POLICY)
    assert d.decision == "accept"
    assert d.quality_recovery == pytest.approx(0.98) and d.speedup == pytest.approx(1.4) and d.size_ratio == pytest.approx(0.3)
    assert "ppl/word_perplexity recovery 0.98 >= 0.95" in d.reason and "speedup 1.40x >= 1.0x" in d.reason
    assert d.policy_hash == POLICY.hash


def test_rejects_and_names_the_failing_metric_first():
    d = decide(VARIANT, 100, rec(0.40), speed(), POLICY)
    assert d.decision == "reject"
    assert d.reason.startswith("reject: ppl/word_perplexity recovery 0.4 < 0.95")


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
