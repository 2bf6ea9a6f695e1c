"""quantgate as users install it: a wheel built from the checkout, installed (not editable) with its dependencies
into a fresh virtual environment, and its CLI run end to end from outside the checkout (so nothing is imported
from the checkout's folders)."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from importlib.metadata import version
from pathlib import Path

import pytest

from tests.shared_data import SHARED

REPO = Path(__file__).resolve().parents[1]


def _modules_in(folder: Path) -> set[str]:
    return {p.relative_to(REPO).with_suffix("").as_posix() for p in folder.rglob("*.py")
            if "__pycache__" not in p.parts and (p.parent / "__init__.py").is_file()}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
                    str(REPO)], check=True)
    (built,) = out.glob("quantgate-*.whl")
    return built


def test_the_wheel_holds_every_module_and_data_file(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    in_wheel = {n.removeprefix("quantgate/").removesuffix(".py") for n in names if n.endswith(".py")}
    for root in ("flows", "tasks", "catalog", "warehouse"):
        missing = _modules_in(REPO / root) - in_wheel
        assert not missing, f"modules left out of the wheel: {sorted(missing)}"
    data = [p.relative_to(REPO).as_posix() for root in ("catalog", "warehouse") for p in (REPO / root).rglob("*")
            if p.suffix in (".yaml", ".sql")]
    assert data and not [d for d in data if f"quantgate/{d}" not in names]


@pytest.mark.slow
def test_the_installed_wheel_runs_a_model_to_its_decisions(wheel, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    # The same torch build as this environment's (a bare `torch` would bring a CUDA build of several GB).
    subprocess.run([str(venv / "bin" / "pip"), "install", "-q", str(wheel), f"torch=={version('torch')}"],
                   check=True, timeout=1200)
    cli = str(venv / "bin" / "quantgate")
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {**os.environ, "QUANTGATE_HOME": str(work / "home"), "QUANTGATE_WAREHOUSE": str(work / "w.ducklake"),
           "QUANTGATE_EVAL_DATA": str(SHARED / "eval"), "PYTHONPATH": ""}

    def quantgate(*args: str) -> subprocess.CompletedProcess:
        done = subprocess.run([cli, *args], cwd=work, env=env, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stderr[-3000:]
        return done

    probe = "import quantgate.tasks.adapters.speed, quantgate.flows.cli as c; print(c.__file__)"
    where = subprocess.run([str(venv / "bin" / "python"), "-c", probe], cwd=work, env=env, capture_output=True,
                           text=True, check=True)
    assert where.stdout.startswith(str(venv)), where.stdout
    catalog = str(REPO / "catalog" / "models.yaml")  # the packaged catalog's local paths point beside a checkout
    assert ": ok" in quantgate("catalog", "validate").stdout  # the packaged catalog and its data files
    assert ": ok" in quantgate("catalog", "validate", catalog).stdout
    quantgate("run", "stories260k", "--variants", "rtn-w2a16-g32", "--catalog", catalog, "--quiet")
    answer = quantgate("sql", "SELECT variant, decision FROM variant_scorecard", "--format", "csv").stdout
    assert "rtn-w2a16-g32," in answer and any(v in answer for v in ("accept", "reject", "inconclusive")), answer
