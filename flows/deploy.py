"""`quantgate deploy`: the work pools and every deployment of prefect.yaml, on the Prefect server of PREFECT_API_URL."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from quantgate.catalog.errors import QuantgateError
from quantgate.catalog.settings import settings

REPO = Path(__file__).resolve().parents[1]
POOLS = {"quantgate-cpu": "the nightly, the release watcher and warehouse upkeep: they start model runs, and measure nothing",
         "quantgate-gpu": "a model's whole run (build, evaluation, KL, benchmarks, decisions) on one host, holding its"
                          " GPUs; one worker per host, --limit its GPU count (1 on a host without GPUs)"}
MODEL_POOL = "quantgate-gpu"
# A flow run of ours whose heartbeats (every 30 s, prefect.yaml) stop for this long is crashed: its host or worker died.
SILENT_S = 90
ZOMBIES = "quantgate: crash runs whose heartbeats stopped"
RETRIES = "quantgate: start crashed model runs again"


REPO_ENV = "QUANTGATE_REPO"


class DeployError(QuantgateError, RuntimeError):
    """Deployment that cannot be done; one line."""


def enter_checkout() -> dict[str, str]:
    """prefect.yaml's pull step, run by the worker before each flow run: work in the checkout named by
    $QUANTGATE_REPO on the worker's machine (read at run time, unlike a `{{ $VAR }}` template, which
    `prefect deploy` resolves on the deploying machine), else the checkout quantgate is installed from."""
    directory = Path(settings().repo or REPO).expanduser().resolve()
    if not (directory / "flows").is_dir():
        raise DeployError(f"{directory}: not a quantgate checkout (set {REPO_ENV} on the worker)")
    os.chdir(directory)
    return {"directory": str(directory)}


def api_url() -> str:
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    if not url:
        raise DeployError("no Prefect server: start one (prefect server start) and set PREFECT_API_URL, e.g. "
                          "http://127.0.0.1:4200/api")
    return url


def ensure_pools(pools: dict[str, str] = POOLS, model_runs: int | None = None) -> list[str]:
    """Create the process work pools that do not exist yet; returns the ones created. `model_runs` caps how many
    model runs the model pool takes at once, over all its hosts (None: its workers' limits alone)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate, WorkPoolUpdate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    created = []
    with get_client(sync_client=True) as client:
        for name, description in pools.items():
            limit = model_runs if name == MODEL_POOL else None
            try:
                client.read_work_pool(name)
                client.update_work_pool(name, WorkPoolUpdate(description=description, concurrency_limit=limit))
                continue
            except ObjectNotFound:
                pass
            try:
                client.create_work_pool(WorkPoolCreate(name=name, type="process", description=description,
                                                       concurrency_limit=limit))
                created.append(name)
            except ObjectAlreadyExists:
                pass
    return created


def ensure_automations(client: Any, deployments: dict[str, str]) -> None:
    """Liveness from Prefect: a run of a quantgate deployment whose heartbeats stop is crashed (Prefect's zombie
    recipe), and a crashed evaluate-model run is scheduled again (`AwaitingRetry`), so that a worker of any host
    resumes it at its first unfinished stage; the run itself stops after QUANTGATE_MAX_ATTEMPTS. A run cancelled from
    Prefect is left alone by both: Prefect refuses Crashed to a run that is Cancelling or Cancelled (neither action
    forces it), and the run reports the worker's SIGTERM as its cancellation, not as a crash (flows/interrupts.py).
    Replaces the automations of the same names, so a redeploy's deployment ids are the ones matched."""
    from datetime import timedelta

    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.automations import AutomationCore, EventTrigger, Posture
    from prefect.events.schemas.events import ResourceSpecification

    ours = ResourceSpecification({"prefect.resource.role": "deployment",
                                  "prefect.resource.id": [f"prefect.deployment.{i}" for i in deployments.values()]})
    flow_runs = ResourceSpecification({"prefect.resource.id": "prefect.flow-run.*"})
    wanted = [
        AutomationCore(
            name=ZOMBIES, description=f"no heartbeat for {SILENT_S} s: the run's worker or host is gone",
            trigger=EventTrigger(
                after={"prefect.flow-run.heartbeat"},
                expect={"prefect.flow-run.heartbeat", "prefect.flow-run.Completed", "prefect.flow-run.Failed",
                        "prefect.flow-run.Cancelled", "prefect.flow-run.Crashed"},
                match=flow_runs, match_related=ours, for_each={"prefect.resource.id"}, posture=Posture.Proactive,
                threshold=1, within=timedelta(seconds=SILENT_S)),
            actions=[ChangeFlowRunState(state=StateType.CRASHED,
                                        message=f"no heartbeat for {SILENT_S} s: its worker or host stopped")]),
        AutomationCore(
            name=RETRIES, description="a crashed evaluate-model run starts again and resumes where it stopped",
            trigger=EventTrigger(
                expect={"prefect.flow-run.Crashed"}, match=flow_runs,
                match_related=ResourceSpecification({"prefect.resource.role": "deployment", "prefect.resource.id":
                                                     f"prefect.deployment.{deployments['evaluate-model']}"}),
                posture=Posture.Reactive, threshold=1, within=timedelta(0)),
            actions=[ChangeFlowRunState(state=StateType.SCHEDULED, name="AwaitingRetry",
                                        message="crashed: started again, to resume at its first unfinished stage")]),
    ]
    for automation in wanted:
        for old in client.read_automations_by_name(automation.name):
            client.delete_automation(old.id)
        client.create_automation(automation)


def deploy(repo: Path = REPO, timeout_s: float = 600, model_runs: int | None = None) -> list[str]:
    """Pools, `prefect deploy --all --no-prompt` in `repo`, then the liveness automations; returns the
    deployments' names."""
    url = api_url()
    repo = Path(repo).resolve()
    if not (repo / "prefect.yaml").is_file():
        raise DeployError(f"{repo}: no prefect.yaml here (pass the checkout the workers run with --repo)")
    ensure_pools(model_runs=model_runs)
    env = {**os.environ, "PREFECT_API_URL": url}
    done = subprocess.run([sys.executable, "-m", "prefect", "deploy", "--all", "--no-prompt"], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        lines = [ln.strip() for ln in (done.stderr + done.stdout).splitlines() if ln.strip()]
        raise DeployError(f"prefect deploy failed: {lines[-1] if lines else f'exit code {done.returncode}'}")
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        deployments = client.read_deployments()
        ensure_automations(client, {d.name: str(d.id) for d in deployments})
        return sorted(f"{client.read_flow(d.flow_id).name}/{d.name}" for d in deployments)
