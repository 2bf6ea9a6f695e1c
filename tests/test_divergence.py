"""KL(base || variant) on the real tiny Llama, against real RTN W4A16 and W2A16 builds."""

from __future__ import annotations

import math
import time

import pytest

from quantgate.catalog.variants import TextCalibration, VariantSpec
from quantgate.tasks.steps.divergence import DivergenceError, kl_divergence, kl_eval_key, kl_report
from quantgate.tasks.steps.quantize import build_variant
from tests.shared_data import SHARED, TINY_MODEL, local_artifact

STORIES = SHARED / "eval" / "simple_stories" / "simple_stories.txt"
SEQ, MAX = 128, 1024

pytestmark = [pytest.mark.skipif(not TINY_MODEL.is_dir() or not STORIES.is_file(), reason="needs ../shared/data"),
              pytest.mark.usefixtures("one_torch_thread")]



@pytest.fixture(scope="module")
def variants(tmp_path_factory: pytest.TempPathFactory) -> dict[int, str]:
    model = local_artifact(TINY_MODEL, "kl-test")
    calib = TextCalibration(samples=4, seq_len=32)  # rtn: not calibrated
    out = tmp_path_factory.mktemp("kl-variants")
    paths = {}
    for bits in (4, 2):
        spec = VariantSpec(name=f"rtn-w{bits}a16-g32", method="rtn", scheme=f"W{bits}A16", group_size=32)
        art = build_variant(model, spec, calib, out)
        assert art.status == "built", art.error
        paths[bits] = art.path
    return paths


def test_base_against_itself_is_zero():
    metric, samples = kl_divergence(str(TINY_MODEL), str(TINY_MODEL), str(STORIES), seq_len=SEQ, max_tokens=MAX)
    assert abs(metric.value) < 1e-6
    assert (metric.task, metric.metric, metric.filter, metric.higher_is_better) == (
        "kl_divergence", "mean_token_kl", "none", False
    )
    # 1024 text tokens in windows of BOS + 127 tokens: 9 windows, 1024 + 9 scored positions.
    assert len(samples) == 9 and [s.doc_id for s in samples] == list(range(9))
    assert metric.n_samples == sum(s.detail["tokens"] for s in samples) == MAX + 9
    assert all(s.detail["top1_agreement"] == 1.0 for s in samples)


def test_fewer_bits_diverge_more(variants):
    start = time.perf_counter()
    w4, s4 = kl_divergence(str(TINY_MODEL), variants[4], str(STORIES), seq_len=SEQ, max_tokens=MAX)
    w2, s2 = kl_divergence(str(TINY_MODEL), variants[2], str(STORIES), seq_len=SEQ, max_tokens=MAX)
    print(f"KL W4A16 {w4.value:.4f} ± {w4.stderr:.4f}, W2A16 {w2.value:.4f} ± {w2.stderr:.4f}"
          f" ({time.perf_counter() - start:.1f} s for both)")  # fmt: skip
    assert 0 < w4.value < w2.value
    assert w4.stderr > 0 and w2.value - w2.stderr > w4.value + w4.stderr
    # The overall mean weights windows by their token counts.
    assert math.isclose(w4.value, sum(s.value * s.detail["tokens"] for s in s4) / w4.n_samples, rel_tol=1e-9)
    assert sum(s.detail["top1_agreement"] for s in s2) < sum(s.detail["top1_agreement"] for s in s4)


def test_report_is_storable_and_keyed_by_text_and_windows(variants, tmp_path):
    report = kl_report(str(TINY_MODEL), variants[4], str(STORIES), seq_len=SEQ, max_tokens=256)
    assert report.status == "ok" and report.evaluator == "quantgate-kl"
    assert report.eval_key == kl_eval_key(str(STORIES), SEQ, 256) and report.eval_key.startswith("kl:")
    assert report.metrics[0].n_samples == 256 + 3 and len(report.samples) == 3
    assert kl_eval_key(str(STORIES), SEQ, 512) != report.eval_key
    copy = tmp_path / "copy.txt"
    copy.write_bytes(STORIES.read_bytes())
    assert kl_eval_key(str(copy), SEQ, 256) == report.eval_key  # content, not path

    failed = kl_report(str(TINY_MODEL), str(tmp_path / "no-model"), str(STORIES), seq_len=SEQ, max_tokens=64)
    assert failed.status == "failed" and failed.metrics == [] and "\n" not in failed.error


def test_bad_text_is_one_line(tmp_path):
    with pytest.raises(DivergenceError, match="cannot read") as err:
        kl_divergence(str(TINY_MODEL), str(TINY_MODEL), str(tmp_path / "missing.txt"))
    assert "\n" not in str(err.value)
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(DivergenceError, match="no tokens"):
        kl_divergence(str(TINY_MODEL), str(TINY_MODEL), str(empty))
