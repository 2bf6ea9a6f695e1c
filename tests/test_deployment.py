"""Against a real `prefect server` on loopback: `quantgate deploy` (prefect.yaml, `prefect deploy --all
--no-prompt`), one process worker per pool, two concurrent evaluate-model runs of different real tiny
models through the deployment (their GPU benchmarks as gpu-step runs on the GPU pool), the warehouse
afterwards, the nightly's schedule as the server stores it, the nightly's "inputs changed" check, and
the release watcher replaying a saved hub listing.

What the CPU run does not cover: a GPU. The GPU pool's worker is a process worker on this machine,
so the gpu-step runs measure vLLM's absence (skipped rows with the reason), not a GPU benchmark.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from quantgate.catalog.records import ModelArtifact
from quantgate.warehouse import store
from tests import prefect_server
from tests.shared_data import REPO, TINY_MODEL

pytestmark = pytest.mark.slow

FIXTURES = Path(__file__).parent / "fixtures"
LISTING = FIXTURES / "hub_list_models_qwen_tinyllama.json"
SEEN_SHA = "7ae557604adf67be50417f59c2c2f167def9a775"  # Qwen/Qwen2.5-0.5B-Instruct in the listing
CLI = [sys.executable, "-m", "quantgate.flows.cli"]

CATALOG = """\
version: 1
variants:
  int8-w8a16: {{method: rtn, scheme: W8A16, group_size: null}}
suites:
  quick:
    tasks:
      - {{name: qg_simple_stories}}
    batch_size: 16
scenarios:
  # vLLM only: on the deployment it is GPU work, so every benchmark is a gpu-step run on the GPU pool.
  tiny-vllm: {{kind: offline, engines: [vllm], num_prompts: 2, input_len: 16, output_len: 4, batch_size: 2,
               repetitions: 1}}
models:
  - id: stories260k
    source: {{kind: local, path: {model}}}
    variants: [int8-w8a16]
    suite: {suite}
    scenarios: [tiny-vllm]
watch:
  - {{author: Qwen, search: Qwen2.5, template: stories260k, limit: 3}}
  - {{author: TinyLlama, template: stories260k, limit: 5}}
policy:
  version: 1
  quality:
    - {{task: qg_simple_stories, metric: bits_per_byte, min_recovery: 0.95, higher_is_better: false}}
"""


def perturbed_copy(src: Path, dst: Path) -> Path:
    """A second real model: the tiny model with one weight changed (another content hash, same shapes)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    for f in dst.iterdir():
        f.chmod(0o644)
    weights = load_file(dst / "model.safetensors")
    name = sorted(k for k in weights if k.endswith("norm.weight"))[0]
    weights[name] = weights[name] * 1.01
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def deployed(tmp_path_factory):
    if not TINY_MODEL.exists():
        pytest.skip(f"shared tiny model not found at {TINY_MODEL}")
    tmp = tmp_path_factory.mktemp("deployment")
    catalog = tmp / "catalog.yaml"
    catalog.write_text(CATALOG.format(model=TINY_MODEL, suite="quick"))
    other = perturbed_copy(TINY_MODEL, tmp / "models" / "stories260k-b")
    extra = {
        "QUANTGATE_REPO": str(REPO),
        "QUANTGATE_WAREHOUSE": str(tmp / "w.ducklake"),
        "QUANTGATE_HOME": str(tmp / "work"),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "QUANTGATE_GPU_SLOT": "gpu:test-host:0",
    }
    with prefect_server.server(tmp / "prefect-home", extra) as (url, env):
        done = subprocess.run([*CLI, "deploy"], env=env, cwd=tmp, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr + done.stdout
        yield {"url": url, "env": env, "tmp": tmp, "catalog": catalog, "other": other, "deploy_out": done.stdout,
               "wh": tmp / "w.ducklake"}


def client(url: str):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    class _Client:
        def __enter__(self):
            self._settings = temporary_settings({PREFECT_API_URL: url})
            self._settings.__enter__()
            self._client = get_client(sync_client=True)
            return self._client.__enter__()

        def __exit__(self, *exc):
            self._client.__exit__(*exc)
            self._settings.__exit__(*exc)

    return _Client()


def deployment_runs(c, name: str) -> list:
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

    dep = c.read_deployment_by_name(name)
    return c.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[dep.id])))


def wait_final(c, ids: list, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        runs = {str(i): c.read_flow_run(i) for i in ids}
        if all(r.state and r.state.is_final() for r in runs.values()) or time.monotonic() > deadline:
            return runs
        time.sleep(2)


def test_deploy_creates_every_deployment_and_the_nightly_schedule(deployed):
    for name in ("evaluate-model/evaluate-model", "nightly/nightly", "watch-releases/watch-releases",
                 "gpu-step/gpu-step", "gpu-suite/gpu-suite", "warehouse-maintenance/warehouse-maintenance"):
        assert name in deployed["deploy_out"]
    with client(deployed["url"]) as c:
        pools = {p.name: p.type for p in c.read_work_pools()}
        assert pools["quantgate-cpu"] == "process" and pools["quantgate-gpu"] == "process"
        nightly = c.read_deployment_by_name("nightly/nightly")
        assert nightly.work_pool_name == "quantgate-cpu"
        assert nightly.parameters["evaluate_deployment"] == "evaluate-model/evaluate-model"
        [schedule] = nightly.schedules
        assert schedule.active and schedule.schedule.cron == "0 2 * * *" and schedule.schedule.timezone == "UTC"
        assert c.read_deployment_by_name("gpu-step/gpu-step").work_pool_name == "quantgate-gpu"
        [upkeep] = c.read_deployment_by_name("warehouse-maintenance/warehouse-maintenance").schedules
        assert upkeep.active and upkeep.schedule.cron == "0 6 * * *"
        evaluate = c.read_deployment_by_name("evaluate-model/evaluate-model")
        assert evaluate.work_pool_name == "quantgate-cpu"
        assert evaluate.parameters["gpu_deployment"] == "gpu-step/gpu-step"
        # Workers pull the flow code from the checkout named on their machine, at run time.
        assert evaluate.pull_steps == [{"quantgate.flows.deploy.enter_checkout": {}}]


def test_two_concurrent_runs_through_workers_leave_a_consistent_warehouse(deployed):
    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_URL, temporary_settings

    env, tmp, wh = deployed["env"], deployed["tmp"], deployed["wh"]
    workers = [
        prefect_server.start([sys.executable, "-m", "prefect", "worker", "start", "--pool", "quantgate-cpu",
                              "--type", "process"], env, tmp / "worker-cpu.log", cwd=tmp),
        prefect_server.start([sys.executable, "-m", "prefect", "worker", "start", "--pool", "quantgate-gpu",
                              "--type", "process", "--limit", "1"], env, tmp / "worker-gpu.log", cwd=tmp),
    ]
    try:
        params = {"catalog": str(deployed["catalog"])}
        with temporary_settings({PREFECT_API_URL: deployed["url"]}):
            first = run_deployment("evaluate-model/evaluate-model", parameters={**params, "model": "stories260k"},
                                   timeout=0)
            second = run_deployment("evaluate-model/evaluate-model",
                                    parameters={**params, "model": str(deployed["other"])}, timeout=0)
        with client(deployed["url"]) as c:
            runs = wait_final(c, [first.id, second.id], timeout_s=420)
            gpu_runs = deployment_runs(c, "gpu-step/gpu-step")
            slot = c.read_global_concurrency_limit_by_name("gpu:test-host:0")
    finally:
        for w in workers:
            prefect_server.stop(w)
    logs = "".join((tmp / f).read_text()[-3000:] for f in ("worker-cpu.log", "worker-gpu.log"))
    for r in runs.values():
        assert r.state.is_completed(), f"{r.name}: {r.state.message}\n{logs}"
    assert {r.name for r in runs.values()} == {"evaluate stories260k", f"evaluate {deployed['other']}"}
    # GPU benchmarks ran as their own runs on the GPU pool, one per variant, under a limit-1 GPU slot.
    assert len(gpu_runs) == 4 and all(r.state.is_completed() for r in gpu_runs)
    assert all(r.parent_task_run_id is not None for r in gpu_runs)  # linked to their evaluate-model run
    assert slot.limit == 1 and slot.active_slots == 0

    with store.session(wh, read_only=True) as con:
        assert sorted(store.rows(con, "SELECT run_id, model_id, status FROM runs ORDER BY model_id"),
                      key=lambda r: r["model_id"]) == sorted(
            [{"run_id": str(first.id), "model_id": "stories260k", "status": "completed"},
             {"run_id": str(second.id), "model_id": "stories260k-b", "status": "completed"}],
            key=lambda r: r["model_id"])
        models = store.rows(con, "SELECT model_id, sha FROM models ORDER BY model_id")
        assert [m["model_id"] for m in models] == ["stories260k", "stories260k-b"]
        assert models[0]["sha"] != models[1]["sha"]
        variants = store.rows(con, "SELECT model_uid, name, status FROM variants ORDER BY model_uid, name")
        assert [(v["name"], v["status"]) for v in variants] == [("base", "built"), ("int8-w8a16", "built")] * 2
        # Nothing lost, nothing twice: each run has its own rows, every table's key is unique.
        per_run = store.rows(con, "SELECT r.run_id, (SELECT count(*) FROM run_variants v WHERE v.run_id = r.run_id) rv,"
                                  " (SELECT count(*) FROM speed_results s WHERE s.run_id = r.run_id) sr,"
                                  " (SELECT count(*) FROM decisions d WHERE d.run_id = r.run_id) de,"
                                  " (SELECT count(*) FROM quality_results q WHERE q.run_id = r.run_id"
                                  "  AND q.metric = 'bits_per_byte') qr FROM runs r")
        assert [(r["rv"], r["sr"], r["de"], r["qr"]) for r in per_run] == [(2, 2, 1, 2)] * 2
        speed = store.rows(con, "SELECT engine, status, reason FROM speed_results")
        assert all(s["engine"] == "vllm" and s["status"] == "skipped" and "vllm" in s["reason"] for s in speed)
        for table, key in (("quality_samples", "variant_uid, eval_key, task, doc_id, metric, filter"),
                           ("speed_results", "run_id, variant_uid, engine, scenario"),
                           ("run_variants", "run_id, variant_uid")):
            total, distinct = con.execute(f"SELECT count(*), count(DISTINCT ({key})) FROM {table}").fetchone()
            assert total == distinct > 0, table
        assert con.execute("SELECT count(*) FROM run_inputs").fetchone()[0] == 2


def test_nightly_starts_only_models_whose_inputs_changed(deployed):
    """After the runs above, the nightly (through the server) skips the unchanged model; a changed
    suite makes it start exactly that model's evaluate-model run."""
    env, tmp = deployed["env"], deployed["tmp"]
    changed = tmp / "catalog-changed.yaml"
    changed.write_text(CATALOG.format(model=TINY_MODEL, suite="quick").replace("batch_size: 16", "batch_size: 8"))
    same = subprocess.run([*CLI, "nightly", "--deployment", "evaluate-model/evaluate-model", "-c",
                           str(deployed["catalog"])], env=env, cwd=tmp, capture_output=True, text=True, timeout=180)
    assert same.returncode == 0, same.stderr
    assert "skip" in same.stdout and "unchanged since run" in same.stdout
    with client(deployed["url"]) as c:
        before = len(deployment_runs(c, "evaluate-model/evaluate-model"))
    moved = subprocess.run([*CLI, "nightly", "--deployment", "evaluate-model/evaluate-model", "-c", str(changed)],
                           env=env, cwd=tmp, capture_output=True, text=True, timeout=180)
    assert moved.returncode == 0, moved.stderr
    assert "changed since run" in moved.stdout and "suite" in moved.stdout
    with client(deployed["url"]) as c:
        runs = deployment_runs(c, "evaluate-model/evaluate-model")
        new = [r for r in runs if "nightly" in r.tags]
    assert len(runs) == before + 1 and len(new) == 1
    assert new[0].parameters["model"] == "stories260k" and new[0].parameters["catalog"] == str(changed)
    assert new[0].name == "evaluate stories260k (nightly)" and "model:stories260k" in new[0].tags


def test_watcher_triggers_exactly_the_new_releases_once(deployed):
    env, tmp, wh = deployed["env"], deployed["tmp"], deployed["wh"]
    listing = json.loads(LISTING.read_text())
    with store.session(wh) as con:  # the warehouse has evaluated one of the listed releases already
        store.record_model(con, "earlier-run", ModelArtifact(
            model_id="Qwen/Qwen2.5-0.5B-Instruct", path="/models/qwen", source="hub", revision=SEEN_SHA, sha=SEEN_SHA))
    watch = [*CLI, "watch", "--deployment", "evaluate-model/evaluate-model", "-c", str(deployed["catalog"])]
    # Qwen: the 3 newest Qwen2.5 models (limit 3; Qwen3 is not the family), one of them already seen;
    # TinyLlama: every model it lists. Models without a commit sha cannot be compared and are skipped.
    newest_qwen = sorted((e for e in listing if e["id"].startswith("Qwen/") and "qwen2.5" in e["id"].lower()),
                         key=lambda e: e["lastModified"], reverse=True)[:3]
    expected = {(e["id"], e["sha"]) for e in newest_qwen if e["sha"] != SEEN_SHA} | {
        (e["id"], e["sha"]) for e in listing if e["id"].startswith("TinyLlama/") and e.get("sha")}
    assert len(expected) >= 3

    first = subprocess.run([*watch, "--listing-file", str(LISTING)], env=env, cwd=tmp, capture_output=True,
                           text=True, timeout=180)
    assert first.returncode == 0, first.stderr
    with client(deployed["url"]) as c:
        triggered = [r for r in deployment_runs(c, "evaluate-model/evaluate-model") if "release" in r.tags]
    assert {(r.parameters["model"], r.parameters["revision"]) for r in triggered} == expected
    assert len(triggered) == len(expected)
    assert all(r.parameters["template"] == "stories260k" for r in triggered)
    assert all(r.name == f"evaluate {r.parameters['model']}@{r.parameters['revision'][:12]} (new release)"
               for r in triggered)

    again = subprocess.run([*watch, "--listing-file", str(LISTING)], env=env, cwd=tmp, capture_output=True,
                           text=True, timeout=180)
    assert again.returncode == 0, again.stderr
    assert "triggered" not in again.stdout and again.stdout.count("seen") >= len(expected)

    # A webhook relay (or a person) names a release directly: new once, then seen.
    direct = "TinyLlama/TinyLlama-1.1B-Chat-v1.0@" + "d" * 40
    for want in ("triggered", "seen"):
        done = subprocess.run([*watch, "--released", direct], env=env, cwd=tmp, capture_output=True, text=True,
                              timeout=180)
        assert done.returncode == 0 and want in done.stdout, done.stderr + done.stdout

    # Offline, the hub listing fails in one line and nothing is triggered.
    offline = subprocess.run(watch, env=env, cwd=tmp, capture_output=True, text=True, timeout=180)
    assert offline.returncode == 1 and "Traceback" not in offline.stderr
    # Prefect logs the run as usual; the command's verdict is its last line, and the only error line.
    errors = [ln for ln in offline.stderr.splitlines() if ln.startswith("error:")]
    assert errors == [offline.stderr.strip().splitlines()[-1]] == [
        "error: cannot list the hub models of Qwen (Qwen2.5): offline mode is on (HF_HUB_OFFLINE=1); nothing triggered"]
    with client(deployed["url"]) as c:
        after = [r for r in deployment_runs(c, "evaluate-model/evaluate-model") if "release" in r.tags]
    assert len(after) == len(expected) + 1
    with store.session(wh, read_only=True) as con:
        assert con.execute("SELECT count(*) FROM release_triggers").fetchone()[0] == len(expected) + 1
