"""Engines started beside the unmeasured work, end to end on a CPU: evaluate-model with the early starts that one
GPU gets (the switch `starts_engines_early` turned on here; nothing else is replaced). Each checkpoint's
Transformers engine loads in its own process as soon as the checkpoint is built, while the builds and
evaluations go on, waits for the GPU clock, and measures after KL, one at a time, its rows stored by the flow.
What this does not cover: vLLM and `vllm serve` on a GPU (tests/gpu/test_clock_gpu.py, and the reference run)."""

from __future__ import annotations

import pytest

from quantgate.flows import evaluate_model as em
from quantgate.warehouse import reads, sessions
from tests.cli_runs import tiny_catalog
from tests.shared_data import TINY_MODEL

pytestmark = pytest.mark.slow


def test_engines_start_while_checkpoints_are_evaluated_and_measure_after_kl(tmp_path, monkeypatch):
    if not TINY_MODEL.exists():
        pytest.skip(f"shared tiny model not found at {TINY_MODEL}")
    monkeypatch.setattr(em, "starts_engines_early", lambda *_: True)
    cat = tiny_catalog(tmp_path, TINY_MODEL, {"rtn-w4a16-g32": "{method: rtn, scheme: W4A16, group_size: 32}",
                                              "gptq-w4a16-g32": "{method: gptq, scheme: W4A16, group_size: 32}",
                                              "rtn-w8a16": "{method: rtn, scheme: W8A16, group_size: null}"},
                       limit=2, min_recovery=0.5, calibration="{kind: text, samples: 4, seq_len: 32}")
    wh = tmp_path / "w.ducklake"
    card = em.evaluate_model(model="tiny", catalog=str(cat), warehouse=str(wh), workdir=str(tmp_path / "work"))
    assert len(card) == 3 and all(r["decision"] in ("accept", "reject", "inconclusive") for r in card)
    with sessions.session(wh, read_only=True) as con:
        stages = reads.rows(con, "SELECT stage, checkpoint, started_at, ended_at FROM stage_times")
        windows = reads.rows(con, "SELECT * FROM measurement_windows")
        speedups = dict(con.execute("SELECT v.name, s.speedup FROM variant_speedup s"
                                    " JOIN variants v USING (variant_uid)").fetchall())
    evaluated = max(s["ended_at"] for s in stages if s["stage"] == "evaluate")
    kl = max(s["ended_at"] for s in stages if s["stage"] == "kl")
    benchmarks = [s for s in stages if s["stage"] == "benchmark"]
    # The base, one W4A16 build (the other takes its rows) and the W8A16 build were measured.
    assert len(windows) == 3 and len(benchmarks) == 4 and all(v is not None for v in speedups.values())
    # Their engines started before the evaluations were over, and measured only after KL, one at a time.
    assert min(s["started_at"] for s in benchmarks) < evaluated
    assert min(w["measured_from"] for w in windows) >= kl
    assert [(w["overlapping_work"], w["overlapping_measurements"]) for w in windows] == [(0, 0)] * 3
    assert max(w["waited_s"] for w in windows) > 0
