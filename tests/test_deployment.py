"""Against a real PostgreSQL and a real `prefect server` on it, on loopback: `quantgate deploy` (pools, prefect.yaml's
deployments, the liveness automations), process workers posing as hosts of the GPU pool, and the warehouse's
catalog in the same PostgreSQL while a read-only SQL session stays open on it. Two models run at once on two
hosts; the same model submitted twice runs one run at a time, the second reusing what the first stored; a host
killed mid-run (`kill -9` of its worker and its run) has its run crashed by Prefect's heartbeat automation and
resumed by the other host. Then the nightly's schedule as the server stores it, its "inputs changed" check and
its order, and the release watcher replaying a saved hub listing.

What the CPU run does not cover: a GPU. The hosts have none, so each run holds its host's CPU slot
(`cpu:<host>`), and vLLM's scenario records vLLM's absence (skipped rows with the reason); the GPU slots and a
model's GPU work on one host are run on the H200 (benchmarks/gpu/deploy.sh).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from quantgate.catalog.records import ModelArtifact
from quantgate.warehouse import reads, sessions, writers
from tests import postgres, prefect_server
from tests.shared_data import REPO, TINY_MODEL
from tests.warehouse_checks import duplicated_keys

pytestmark = pytest.mark.slow

FIXTURES = Path(__file__).parent / "fixtures"
LISTING = FIXTURES / "hub_list_models_qwen_tinyllama.json"
SEEN_SHA = "7ae557604adf67be50417f59c2c2f167def9a775"  # Qwen/Qwen2.5-0.5B-Instruct in the listing
CLI = [sys.executable, "-m", "quantgate.flows.cli"]
EVALUATE = "evaluate-model/evaluate-model"

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

# A person's SQL session on the warehouse: read-only, one snapshot held open until told to go on, then a new one.
READER = """
import sys
from quantgate.warehouse import reads, sessions, writers
with sessions.session(read_only=True) as con:
    print("open", con.execute("SELECT count(*) FROM runs").fetchone()[0], flush=True)
    sys.stdin.readline()
    print("held", con.execute("SELECT count(*) FROM runs").fetchone()[0], flush=True)
with sessions.session(read_only=True) as con:
    print("after", con.execute("SELECT count(*) FROM runs").fetchone()[0], flush=True)
"""


def perturbed_copy(src: Path, dst: Path, scale: float = 1.01) -> Path:
    """Another real model: the tiny model with one weight changed (another content hash, same shapes)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    for f in dst.iterdir():
        f.chmod(0o644)
    weights = load_file(dst / "model.safetensors")
    name = sorted(k for k in weights if k.endswith("norm.weight"))[0]
    weights[name] = weights[name] * scale
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def deployed(tmp_path_factory):
    if not TINY_MODEL.exists():
        pytest.skip(f"shared tiny model not found at {TINY_MODEL}")
    if postgres.server_bin() is None:
        pytest.skip("PostgreSQL's server is not installed (apt-get install postgresql; .ci/run does)")
    tmp = tmp_path_factory.mktemp("deployment")
    catalog = tmp / "catalog.yaml"
    catalog.write_text(CATALOG.format(model=TINY_MODEL, suite="quick"))
    models = {name: perturbed_copy(TINY_MODEL, tmp / "models" / name, 1 + k / 100)
              for k, name in enumerate(("stories260k-b", "stories260k-c", "stories260k-d"), start=1)}
    with postgres.postgres_server() as conninfo:
        extra = {
            "PREFECT_API_DATABASE_CONNECTION_URL": postgres.database(conninfo, "prefect"),
            "QUANTGATE_REPO": str(REPO),
            sessions.ENV_VAR: f"postgres:{conninfo}",
            sessions.DATA_ENV_VAR: str(tmp / "lake") + "/",
            "QUANTGATE_HOME": str(tmp / "work"),
            "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
            # Hosts without GPUs; a dead host's slots come back 60 s after their last renewal (Prefect's least).
            "CUDA_VISIBLE_DEVICES": "",
            "PREFECT_SERVER_SERVICES_REPOSSESSOR_LOOP_SECONDS": "5",
            "PREFECT_WORKER_QUERY_SECONDS": "2",
        }
        with prefect_server.server(tmp / "prefect-home", extra) as (url, env):
            done = subprocess.run([*CLI, "deploy"], env=env, cwd=tmp, capture_output=True, text=True, timeout=300)
            assert done.returncode == 0, done.stderr + done.stdout
            with pytest.MonkeyPatch.context() as mp:  # this process reads the same warehouse as the workers
                mp.setenv(sessions.ENV_VAR, extra[sessions.ENV_VAR])
                mp.setenv(sessions.DATA_ENV_VAR, extra[sessions.DATA_ENV_VAR])
                with sessions.session():
                    pass  # the warehouse exists before the reader opens it, as a team's does
                yield {"url": url, "env": env, "tmp": tmp, "catalog": catalog, "models": models,
                       "deploy_out": done.stdout, "wh": extra[sessions.ENV_VAR]}


class Hosts:
    """Process workers of the GPU pool, each posing as a host of its own (QUANTGATE_HOST)."""

    def __init__(self, deployed: dict) -> None:
        self.env, self.tmp = deployed["env"], deployed["tmp"]
        self.workers: dict[str, subprocess.Popen] = {}

    def start(self, host: str, **env: str) -> None:
        self.workers[host] = prefect_server.start(
            [sys.executable, "-m", "prefect", "worker", "start", "--pool", "quantgate-gpu", "--type", "process",
             "--limit", "1", "--name", host], {**self.env, "QUANTGATE_HOST": host, **env},
            self.tmp / f"worker-{host}.log", cwd=self.tmp)

    def stop(self, host: str) -> None:
        prefect_server.stop(self.workers.pop(host))

    def kill(self, host: str, run_pid: int) -> None:
        """The host dies: its worker and the run it was running, with everything they started, by SIGKILL."""
        for pgid in {os.getpgid(run_pid), self.workers[host].pid} - {os.getpgrp()}:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.kill(run_pid, signal.SIGKILL)
        self.workers.pop(host).wait(30)

    def logs(self) -> str:
        return "".join(f.read_text()[-3000:] for f in sorted(self.tmp.glob("worker-*.log")))

    def stop_all(self) -> None:
        for host in list(self.workers):
            self.stop(host)


def wait_paused(paused: Path, hosts: Hosts, timeout_s: float = 300) -> int:
    """The pid of the run paused at its fault point (QUANTGATE_FAULT=…=pause), once it has written `paused`; the
    hosts' logs when it never does, since a run that failed before its fault point says why only there."""
    deadline = time.monotonic() + timeout_s
    while not paused.exists() and time.monotonic() < deadline:
        time.sleep(1)
    assert paused.exists(), hosts.logs()
    return int(paused.read_text().split()[1])


@pytest.fixture(scope="module")
def hosts(deployed):
    hosts = Hosts(deployed)
    hosts.start("host-a")
    hosts.start("host-b")
    try:
        yield hosts
    finally:
        hosts.stop_all()


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


def submit(deployed: dict, model: str) -> str:
    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: deployed["url"]}):
        return str(run_deployment(EVALUATE, parameters={"catalog": str(deployed["catalog"]), "model": model},
                                  timeout=0).id)


def attempts(deployed: dict, model_id: str) -> list[dict]:
    with sessions.session(deployed["wh"], read_only=True) as con:
        return reads.rows(con, "SELECT r.run_id, r.status AS run_status, r.started_at AS run_started,"
                               " r.finished_at AS run_finished, a.attempt_id, a.host, a.status FROM runs r"
                               " JOIN run_attempts a USING (run_id) WHERE r.model_id = ? ORDER BY a.started_at",
                          [model_id])


def test_deploy_creates_every_deployment_the_automations_and_the_nightly_schedule(deployed):
    for name in (EVALUATE, "nightly/nightly", "watch-releases/watch-releases", "gpu-suite/gpu-suite",
                 "warehouse-maintenance/warehouse-maintenance"):
        assert name in deployed["deploy_out"]
    with client(deployed["url"]) as c:
        pools = {p.name: p.type for p in c.read_work_pools()}
        assert pools["quantgate-cpu"] == "process" and pools["quantgate-gpu"] == "process"
        nightly = c.read_deployment_by_name("nightly/nightly")
        assert nightly.work_pool_name == "quantgate-cpu"
        assert [s.schedule.cron for s in nightly.schedules] == ["0 2 * * *"]
        assert nightly.parameters["evaluate_deployment"] == EVALUATE
        evaluate = c.read_deployment_by_name(EVALUATE)
        # A model's whole run goes to the GPU pool, with heartbeats often enough to be crashed within 90 s.
        assert evaluate.work_pool_name == "quantgate-gpu"
        assert evaluate.job_variables["env"]["PREFECT_FLOWS_HEARTBEAT_FREQUENCY"] == "30"
        assert evaluate.pull_steps == [{"quantgate.flows.deploy.enter_checkout": {}}]
        names = {a.name for a in c.read_automations()}
        assert {"quantgate: crash runs whose heartbeats stopped", "quantgate: start crashed model runs again"} <= names


def test_two_hosts_run_two_models_at_once_while_a_reader_holds_a_session(deployed, hosts):
    env = {**deployed["env"]}
    reader = subprocess.Popen([sys.executable, "-c", READER], env=env, cwd=REPO, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        opened = reader.stdout.readline()
        assert opened.split() == ["open", "0"], opened + (reader.stderr.read() if reader.poll() is not None else "")
        first, second = submit(deployed, "stories260k"), submit(deployed, str(deployed["models"]["stories260k-b"]))
        with client(deployed["url"]) as c:
            runs = wait_final(c, [first, second], timeout_s=480)
        reader.stdin.write("go on\n")
        reader.stdin.flush()
        out, err = reader.communicate(timeout=120)
    finally:
        if reader.poll() is None:
            reader.kill()
    for r in runs.values():
        assert r.state.is_completed(), f"{r.name}: {r.state.message}\n{hosts.logs()}"
    assert reader.returncode == 0, err
    assert out.split() == ["held", "0", "after", "2"]  # its snapshot held while both runs wrote, then it saw them
    a, b = attempts(deployed, "stories260k"), attempts(deployed, "stories260k-b")
    assert [x["run_id"] for x in a] == [first] and [x["run_id"] for x in b] == [second]
    assert {a[0]["host"], b[0]["host"]} == {"host-a", "host-b"}  # one host each, at the same time
    assert a[0]["run_started"] < b[0]["run_finished"] and b[0]["run_started"] < a[0]["run_finished"]
    with sessions.session(deployed["wh"], read_only=True) as con:
        assert duplicated_keys(con) == {}
        decided = reads.rows(con, "SELECT run_id, variant_uid, decision FROM decisions ORDER BY run_id")
        assert sorted(d["run_id"] for d in decided) == sorted([first, second])
        speed = reads.rows(con, "SELECT engine, status, reason FROM speed_results")
        assert speed and all(s["engine"] == "vllm" and s["status"] == "skipped" and "vllm" in s["reason"] for s in speed)


def test_the_same_model_submitted_twice_runs_once_at_a_time_and_the_second_reuses(deployed, hosts):
    model = str(deployed["models"]["stories260k-c"])
    first, second = submit(deployed, model), submit(deployed, model)
    with client(deployed["url"]) as c:
        runs = wait_final(c, [first, second], timeout_s=480)
    for r in runs.values():
        assert r.state.is_completed(), f"{r.name}: {r.state.message}\n{hosts.logs()}"
    done = attempts(deployed, "stories260k-c")
    assert sorted(x["run_id"] for x in done) == sorted([first, second])
    earlier, later = done
    assert earlier["run_finished"] <= later["run_started"]  # one at a time: the model's lock
    with sessions.session(deployed["wh"], read_only=True) as con:
        assert duplicated_keys(con) == {}
        # One base and one build, stored once; the second run links them and their evaluations.
        variants = reads.rows(con, "SELECT v.name FROM variants v JOIN models m ON v.model_uid = m.model_uid"
                                   " WHERE m.model_id = 'stories260k-c' ORDER BY v.name")
        assert [v["name"] for v in variants] == ["base", "int8-w8a16"]
        per_run = reads.rows(con, "SELECT run_id, count(*) AS n FROM run_variants WHERE run_id IN (?, ?) GROUP BY ALL",
                             [first, second])
        assert sorted(r["n"] for r in per_run) == [2, 2]
        evaluated = reads.rows(con, "SELECT run_id, count(*) AS n FROM quality_results WHERE run_id IN (?, ?)"
                                    " AND metric = 'bits_per_byte' GROUP BY ALL", [first, second])
        assert evaluated == [{"run_id": earlier["run_id"], "n": 2}]  # evaluated once, by the first
        linked = reads.rows(con, "SELECT eval_key FROM run_variants WHERE run_id = ?", [later["run_id"]])
        assert len(linked) == 2 and all(r["eval_key"] for r in linked)
        samples = con.execute("SELECT count(*), count(DISTINCT (variant_uid, eval_key, task, doc_id, metric, filter))"
                              " FROM quality_samples").fetchone()
        assert samples[0] == samples[1]
        marks = reads.rows(con, "SELECT detail FROM run_stages WHERE run_id = ? AND stage = 'quantize'",
                           [later["run_id"]])
        assert marks and all(m["detail"] for m in marks)


def test_a_host_killed_mid_run_is_crashed_by_prefect_and_resumed_on_the_other(deployed, hosts):
    """host-c takes the run and pauses in the variant's evaluation; it is killed with its worker (no word to
    anyone); Prefect's heartbeat automation crashes the run, the retry automation schedules it again, and host-b
    resumes it after the base's evaluation."""
    paused = deployed["tmp"] / "paused.txt"
    hosts.stop("host-a")
    hosts.stop("host-b")  # host-c alone takes the run
    hosts.start("host-c", QUANTGATE_FAULT="evaluate@2=pause", QUANTGATE_FAULT_PAUSED=str(paused))
    run_id = submit(deployed, str(deployed["models"]["stories260k-d"]))
    pid = wait_paused(paused, hosts)
    hosts.kill("host-c", pid)
    killed_at = time.monotonic()
    hosts.start("host-b")
    with client(deployed["url"]) as c:
        deadline = time.monotonic() + 420
        while True:  # through Crashed (the automation schedules it again) to its end
            run = c.read_flow_run(run_id)
            if run.state.type.value in ("COMPLETED", "FAILED", "CANCELLED") or time.monotonic() > deadline:
                break
            time.sleep(2)
        states = [(s.type.value, s.name, s.message) for s in c.read_flow_run_states(run_id)]
    assert run.state.is_completed(), f"{run.state.message}\n{states}\n{hosts.logs()}"
    crashed = [s for s in states if s[0] == "CRASHED"]
    assert crashed and "no heartbeat" in crashed[0][2], states
    assert ("SCHEDULED", "AwaitingRetry") in [(t, n) for t, n, _ in states]
    assert time.monotonic() - killed_at < 400
    done = attempts(deployed, "stories260k-d")
    assert [(x["run_id"], x["attempt_id"], x["host"], x["status"]) for x in done] == [
        (run_id, run_id, "host-c", "abandoned"), (run_id, f"{run_id}#2", "host-b", "completed")]
    with sessions.session(deployed["wh"], read_only=True) as con:
        assert duplicated_keys(con) == {}
        by_attempt = reads.rows(con, "SELECT stage, item, attempt_id FROM run_stages WHERE run_id = ? ORDER BY stage, item",
                                [run_id])
    first = {(m["stage"], m["item"]) for m in by_attempt if m["attempt_id"] == run_id}
    # Download, the build and the base's evaluation were stored before the kill, and not done again.
    assert {s for s, _ in first} == {"download", "quantize", "evaluate"} and len(first) == 3
    assert {m["stage"] for m in by_attempt if m["attempt_id"] == f"{run_id}#2"} == {"evaluate", "kl", "benchmark",
                                                                                    "decide"}


def test_nightly_starts_only_models_whose_inputs_changed(deployed):
    """After the runs above, the nightly (through the server) skips the unchanged model; a changed
    suite makes it start exactly that model's evaluate-model run, in an order its artifact states."""
    from prefect.client.schemas.actions import WorkPoolUpdate
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    env, tmp = deployed["env"], deployed["tmp"]
    with client(deployed["url"]) as c:  # the runs it starts wait in the pool, to be looked at
        c.update_work_pool("quantgate-gpu", WorkPoolUpdate(is_paused=True))
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
    with client(deployed["url"]) as c:
        plans = c.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["nightly-plan"])))
    plan = max(plans, key=lambda a: a.created).data
    assert "Runs start in the order below, on pool quantgate-gpu (no pool-wide limit;" in plan
    assert "| 1 | stories260k | run | submitted | " in plan and str(new[0].id) in plan


def test_watcher_triggers_exactly_the_new_releases_once(deployed):
    env, tmp, wh = deployed["env"], deployed["tmp"], deployed["wh"]
    listing = json.loads(LISTING.read_text())
    with sessions.session(wh) as con:  # the warehouse has evaluated one of the listed releases already
        writers.record_model(con, "earlier-run", ModelArtifact(
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
    with sessions.session(wh, read_only=True) as con:
        assert con.execute("SELECT count(*) FROM release_triggers").fetchone()[0] == len(expected) + 1
