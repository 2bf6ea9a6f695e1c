"""GPU lanes on a CPU: evaluate-model with two fake GPU ids runs the benchmarks of different checkpoints side by
side, each in a real spawned process that sees only its own id (CUDA_VISIBLE_DEVICES), their rows stored by the
flow, the one writer, as they arrive. What this does not cover: a real GPU (the ids are only names here, and the
engines run on the CPU); the device run is `benchmarks/gpu/run_reference.sh` with `--gpus`."""

from __future__ import annotations

from pathlib import Path

import pytest

from quantgate.flows.evaluate_model import evaluate_model
from quantgate.tasks.runtime import launch
from quantgate.warehouse import reads, sessions
from tests.cli_runs import CATALOG_HEAD
from tests.shared_data import TINY_MODEL

pytestmark = pytest.mark.slow


def catalog(tmp: Path) -> Path:
    path = tmp / "catalog.yaml"
    path.write_text(CATALOG_HEAD + f"""scenarios:
  # Two scenarios that need the same engine options: one engine start per checkpoint.
  # transformers_decompressed: the CPU's one engine times the compressed builds too (lanes under test).
  short: {{kind: offline, engines: [transformers], device: cpu, num_prompts: 2, input_len: 8, output_len: 4,
          batch_size: 2, repetitions: 1, warmup: 0, max_model_len: 40, transformers_decompressed: true}}
  long: {{kind: latency, engines: [transformers], device: cpu, num_prompts: 2, input_len: 16, output_len: 24,
         repetitions: 1, warmup: 1, max_model_len: 40, transformers_decompressed: true}}
models:
  - id: tiny
    source: {{kind: local, path: {TINY_MODEL}}}
    variants: [int8-w8a16]
    suite: stories
    scenarios: [short, long]
policy:
  version: 1
  quality: [{{task: qg_simple_stories, metric: bits_per_byte, min_recovery: 0.5, higher_is_better: false}}]
  max_size_ratio: 1.0
""")
    return path


def test_lanes_from_gpus_and_the_environment(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert launch.lanes_from(None) == ["2", "3"]
    assert launch.lanes_from("0") == ["0"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert launch.lanes_from(None) == [None]  # one GPU: measure in this process's own view
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert launch.lanes_from(None) == [None]


def test_two_lanes_measure_two_checkpoints_side_by_side_each_on_its_own_gpu(tmp_path):
    if not TINY_MODEL.exists():
        pytest.skip(f"shared tiny model not found at {TINY_MODEL}")
    wh = str(tmp_path / "w.ducklake")
    card = evaluate_model(model="tiny", catalog=str(catalog(tmp_path)), warehouse=wh, workdir=str(tmp_path / "work"),
                          gpus="0,1")
    run_id = card[0]["run_id"]
    with sessions.session(wh, read_only=True) as con:
        rows = reads.rows(con, "SELECT v.name, s.scenario, s.status, s.details->>'cuda_visible_devices' AS gpu"
                               " FROM speed_results s JOIN variants v USING (variant_uid) WHERE run_id = ?", [run_id])
        stages = reads.rows(con, "SELECT checkpoint, started_at, ended_at, engine_starts FROM stage_times"
                                 " WHERE run_id = ? AND stage = 'benchmark' ORDER BY checkpoint", [run_id])
    assert sorted((r["name"], r["scenario"], r["status"]) for r in rows) == [
        ("base", "long", "ok"), ("base", "short", "ok"), ("int8-w8a16", "long", "ok"), ("int8-w8a16", "short", "ok")]
    # Each checkpoint was measured by a process that saw one GPU id, its lane's, and the two lanes both worked.
    by_checkpoint = {name: {r["gpu"] for r in rows if r["name"] == name} for name in ("base", "int8-w8a16")}
    assert all(len(ids) == 1 for ids in by_checkpoint.values())
    assert set().union(*by_checkpoint.values()) == {"0", "1"}
    # Side by side: the two benchmark stages overlap in time; one engine start each for its two scenarios, and the
    # base's beside the variant's, whose passes alternate with it.
    (a, b) = stages
    assert a["started_at"] < b["ended_at"] and b["started_at"] < a["ended_at"]
    assert [s["engine_starts"] for s in stages] == [1, 2]
