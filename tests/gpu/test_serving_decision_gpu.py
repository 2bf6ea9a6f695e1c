"""Serving inside evaluate-model on the device: dispatch runs a serving scenario with a sweep of two points for a
base and a variant (the tiny model and a copy of it) as real `vllm serve` starts, the flow's warehouse writers store
the loads, variant_serving picks each one's tuned point, and the decision's serving check carries it.
tests/test_sweep_cost.py checks the view's picks on chosen timings; this checks the real path. The second point,
a lower max_num_seqs, is one the sweep skips on real readings: the defaults' KV cache (read from the server's
log) holds the highest load whole and the generous SLO is met at every load, so it cannot change the outcome
(two eager starts, ~1-2 min; tests/gpu/test_sweep_gpu.py runs every point of a W4A16 sweep). Its servers' KV
caches are sized (no gpu_memory_utilization of their own), so vLLM does not profile free memory at their start,
which other test workers' engines coming and going on the same GPU upset (gpu-tests/call-s12-all.txt)."""

from __future__ import annotations

import importlib.util
import shutil

import pytest
import torch
from prefect import flow

from quantgate.catalog.load import load_catalog
from quantgate.catalog.paths import DEFAULT_CATALOG
from quantgate.catalog.policy import Policy
from quantgate.catalog.records import VariantArtifact
from quantgate.catalog.scenarios import scenario_from
from quantgate.flows import dispatch
from quantgate.tasks.steps.decide import decide
from quantgate.warehouse import ledger, reads, sessions, writers
from tests.shared_data import TINY_MODEL

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None or not torch.cuda.is_available(),
                       reason="needs vllm and a CUDA GPU"),
]

SCENARIO = {"kind": "serving", "engines": ["vllm"], "num_prompts": 8, "input_len": 32, "output_len": 16,
            "max_model_len": 64, "enforce_eager": True, "concurrency": [1, 8],
            "rounds": 1, "slo": {"ttft_ms": 10_000, "tpot_ms": 1_000}, "sweep": {"max_num_seqs": [4]}}


def _artifact(uid: str, path: str) -> VariantArtifact:
    return VariantArtifact(uid=uid, model_uid="tiny@0", name=uid, method="base", scheme=None, bits=16,
                           group_size=None, path=path, recipe=None, recipe_hash=None, size_bytes=1)


def test_a_swept_serving_scenario_is_stored_and_judged_on_its_tuned_point(tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(TINY_MODEL, copy)
    base, variant = _artifact("base", str(TINY_MODEL)), _artifact("copy", str(copy))
    cat = load_catalog(DEFAULT_CATALOG)
    cat = cat.model_copy(update={"scenarios": {**cat.scenarios, "srv": scenario_from(SCENARIO)}})
    spec = cat.model("stories260k").model_copy(update={"scenarios": ("srv",)})
    wh = tmp_path / "w.ducklake"
    with sessions.session(wh) as con:
        ledger.start_run(con, "r", "evaluate-model", "tiny", "catalog", "h", "host", {})
        writers.record_variant(con, "r", base, "base")
        writers.record_variant(con, "r", variant, "variant")

    def keep(uid: str, result: dispatch.JobResult) -> None:
        with sessions.session(wh) as con:
            writers.record_measured(con, "r", uid, result.measured)

    @flow
    def run() -> dict:
        return dispatch.benchmark_all([base, variant], spec, cat, tmp_path / "work", on_variant=keep)

    measured = {uid: result.measured for uid, result in run().items()}
    assert [r.scenario for r, _ in measured["copy"]] == ["srv@default", "srv@max_num_seqs=4"]
    (default, default_loads), (lower, lower_loads) = measured["copy"]
    assert default.status == "ok" and len(default_loads) == 2 and default.kv_cache_tokens >= 8 * (32 + 16), default
    assert lower.status == "skipped" and "cannot change the outcome" in (lower.reason or "") and not lower_loads
    assert sum(r.details.get("engine_starts", 0) for r, _ in measured["copy"]) == 1  # the skipped point started nothing
    with sessions.session(wh, read_only=True) as con:
        (row,) = reads.rows(con, "SELECT * FROM variant_serving")
    assert row["variant_uid"] == "copy" and (row["points"], row["points_ok"]) == (2, 1) and row["point"] == "default"
    assert row["goodput_requests_per_s"] > 0 and row["goodput_ratio"] > 0
    policy = Policy.model_validate({"version": 1, "quality": [],
                                    "serving": {"scenario": "srv", "min_goodput_ratio": 0.01}})
    d = decide({"variant_uid": "copy", "status": "built", "error": None, "size_bytes": 1}, 2, [], [], policy,
               serving=[row])
    (check,) = [c for c in d.checks if c.name == "serving srv"]
    assert check.outcome == "pass" and check.detail["point"] == row["point"] and check.detail["load"] == row["load"]
