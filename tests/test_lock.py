"""The locked stack: this environment is exactly requirements/cpu.txt (what `make setup` installs), both locks hold
what pyproject.toml and the overrides say, and a run records the lock it ran from.

That the locks still resolve from pyproject.toml, and that every pin of the GPU lock has a wheel for a GPU host, is
checked by `make lock-check` in .ci/run (it needs the package registry); the GPU environment's drift from
requirements/gpu.txt is printed by benchmarks/gpu/install_lock.sh where it is installed."""

from __future__ import annotations

import hashlib
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from quantgate.tasks.runtime import environment

REPO = Path(__file__).resolve().parents[1]
CPU_LOCK, GPU_LOCK = REPO / "requirements/cpu.txt", REPO / "requirements/gpu.txt"


def _pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def test_this_environment_is_exactly_the_cpu_lock():
    have = environment.installed()
    if environment.lock_kind(have) != "cpu":
        pytest.skip("a GPU environment (vLLM installed): benchmarks/gpu/install_lock.sh prints its drift from "
                    "requirements/gpu.txt")
    pinned = environment.pins(CPU_LOCK)
    assert environment.drift(pinned, have) == []
    # Nothing beyond the lock but the installer and quantgate itself.
    assert set(have) - set(pinned) <= {"pip", "quantgate"}


@pytest.mark.parametrize("lock", [CPU_LOCK, GPU_LOCK], ids=["cpu", "gpu"])
def test_each_lock_meets_pyprojects_requirements(lock):
    pinned = environment.pins(lock)
    project = _pyproject()["project"]
    wanted = [Requirement(r) for r in project["dependencies"]]
    wanted += [Requirement(r) for r in project["optional-dependencies"]["gpu" if lock == GPU_LOCK else "test"]]
    overridden = {environment.canonical(Requirement(line.split(";")[0]).name)
                  for line in (REPO / "requirements/overrides.txt").read_text().splitlines()
                  if line.strip() and not line.startswith("#")}
    unmet = [f"{r} (lock {pinned.get(environment.canonical(r.name), 'absent')})" for r in wanted
             if environment.canonical(r.name) not in overridden
             and not r.specifier.contains(pinned.get(environment.canonical(r.name), "0"), prereleases=True)]
    assert unmet == []


def test_the_locks_settle_the_compressed_tensors_conflict_and_keep_prefects_scheduler_working():
    cpu, gpu = environment.pins(CPU_LOCK), environment.pins(GPU_LOCK)
    # vLLM pins compressed-tensors 0.17.0; the override gives both locks llm-compressor's 0.19.0.
    assert cpu["compressed-tensors"] == gpu["compressed-tensors"] == "0.19.0"
    assert gpu["vllm"] == "0.26.0" and gpu["torch"] == "2.11.0" and cpu["torch"].endswith("+cpu")
    # Prefect 3.7's scheduler needs SQLAlchemy 2.0; fastapi below vLLM's and Prefect 3.7's cap.
    for pins in (cpu, gpu):
        assert pins["sqlalchemy"].startswith("2.0.") and pins["prefect"].startswith("3.7.")
        assert tuple(int(x) for x in pins["fastapi"].split(".")[:2]) < (0, 137)
    # What the overrides leave out is out of the GPU lock (its never-true marker), not merely unpinned.
    assert "nvidia-cutlass-dsl" not in gpu and "llama-cpp-python" not in cpu


def test_drift_names_each_package_off_its_pin_and_reads_local_builds_as_pip_does(tmp_path):
    lock = tmp_path / "lock.txt"
    lock.write_text("# header\ntorch==2.11.0\n    # via vllm\nnumpy==2.3.5\nfoo-bar==1.0 ; python_version < '4'\n"
                    "torchcpu==2.13.0+cpu\n")
    pinned = environment.pins(lock)
    assert pinned == {"torch": "2.11.0", "numpy": "2.3.5", "foo-bar": "1.0", "torchcpu": "2.13.0+cpu"}
    have = {"torch": "2.11.0+cu130", "numpy": "2.5.2", "foo-bar": "1.0", "torchcpu": "2.13.0"}
    assert environment.drift(pinned, have) == ["numpy 2.5.2 (lock 2.3.5)", "torchcpu 2.13.0 (lock 2.13.0+cpu)"]
    assert environment.drift(pinned, {}) == [f"{n} absent (lock {v})" for n, v in sorted(pinned.items())]


def test_the_program_names_this_checkouts_lock_by_its_hash():
    program = environment.program()
    kind = environment.lock_kind(environment.installed())
    lock = REPO / environment.LOCKS[kind]
    assert program["lock"] == f"{environment.LOCKS[kind]} sha256:{hashlib.sha256(lock.read_bytes()).hexdigest()[:16]}"
    assert program["lock_drift"] == "none" or program["lock_drift"].split(":")[0].isdigit()
