"""`quantgate deploy`: the work pools and every deployment of prefect.yaml, on the Prefect server of PREFECT_API_URL."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from quantgate.catalog.errors import QuantgateError
from quantgate.catalog.settings import settings

REPO = Path(__file__).resolve().parents[1]
POOLS = {"quantgate-cpu": "download, quantize and evaluate small models, decisions, warehouse writes",
         "quantgate-gpu": "GPU steps (gpu-step, gpu-suite): one GPU per worker"}


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


def ensure_pools(pools: dict[str, str] = POOLS) -> list[str]:
    """Create the process work pools that do not exist yet; returns the ones created."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    created = []
    with get_client(sync_client=True) as client:
        for name, description in pools.items():
            try:
                client.read_work_pool(name)
                continue
            except ObjectNotFound:
                pass
            try:
                client.create_work_pool(WorkPoolCreate(name=name, type="process", description=description))
                created.append(name)
            except ObjectAlreadyExists:
                pass
    return created


def deploy(repo: Path = REPO, timeout_s: float = 600) -> list[str]:
    """Pools, then `prefect deploy --all --no-prompt` in `repo`; returns the deployments' names."""
    url = api_url()
    repo = Path(repo).resolve()
    if not (repo / "prefect.yaml").is_file():
        raise DeployError(f"{repo}: no prefect.yaml here (pass the checkout the workers run with --repo)")
    ensure_pools()
    env = {**os.environ, "PREFECT_API_URL": url}
    done = subprocess.run([sys.executable, "-m", "prefect", "deploy", "--all", "--no-prompt"], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        lines = [ln.strip() for ln in (done.stderr + done.stdout).splitlines() if ln.strip()]
        raise DeployError(f"prefect deploy failed: {lines[-1] if lines else f'exit code {done.returncode}'}")
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return sorted(f"{client.read_flow(d.flow_id).name}/{d.name}" for d in client.read_deployments())
