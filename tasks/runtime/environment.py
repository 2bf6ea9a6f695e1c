"""The program a run is: the versions of the libraries it names (`library_versions`, the one place a run, a build,
a model's inputs or a speed row learns them), which lock of the checkout (requirements/cpu.txt or
requirements/gpu.txt) this environment was installed from, its hash, and every locked package whose installed
version differs from its pin.

Recorded with each run's library versions, so that a verdict names the program that made it. An installed wheel
(no checkout beside it) has no lock to name, and says so."""

from __future__ import annotations

import hashlib
import importlib.metadata
import re
from collections.abc import Iterable
from functools import cache
from pathlib import Path

# The checkout: this file is tasks/runtime/environment.py in it (an editable install or the device's shim of links).
CHECKOUT = Path(__file__).resolve().parents[2]
LOCKS = {"cpu": "requirements/cpu.txt", "gpu": "requirements/gpu.txt"}
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;]+)")


def library_versions(names: Iterable[str], *, required: bool = False) -> dict[str, str]:
    """{name: installed version} of each distribution `names` lists, in that order. One that is not installed is
    left out, or, when `required` (a library the caller cannot run without), raises PackageNotFoundError."""
    found: dict[str, str] = {}
    for name in names:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            if required:
                raise
    return found


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(lock: Path) -> dict[str, str]:
    """{canonical name: pinned version} of a lock file written by `make lock`."""
    return {canonical(m[1]): m[2] for line in lock.read_text().splitlines() if (m := _PIN.match(line))}


def installed() -> dict[str, str]:
    """{canonical name: version} of every distribution this interpreter sees (the first of a name wins, as imports do)."""
    found: dict[str, str] = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            found.setdefault(canonical(name), dist.version)
    return found


def _same(pinned: str, have: str) -> bool:
    """A pin without a local label (`2.11.0`) is met by any local build of that version (`2.11.0+cu130`), as pip's
    `==` is; a pin with one (`2.13.0+cpu`) only by that build."""
    return have == pinned or ("+" not in pinned and have.split("+", 1)[0] == pinned)


def drift(lock_pins: dict[str, str], have: dict[str, str]) -> list[str]:
    """The locked packages this environment holds at another version, or not at all: `name have (lock pinned)`."""
    return [f"{name} {have.get(name, 'absent')} (lock {pinned})"
            for name, pinned in sorted(lock_pins.items()) if not _same(pinned, have.get(name, ""))]


def lock_kind(have: dict[str, str]) -> str:
    """The GPU lock where vLLM is installed (its `gpu` extra), else the CPU lock."""
    return "gpu" if "vllm" in have else "cpu"


@cache
def program() -> dict[str, str]:
    """{"lock": "<path> sha256:<16 hex>", "lock_drift": "none" | "<n>: <name have (lock pin)>, ..."}; without a
    checkout's lock, {"lock": "none: not installed from a checkout's lock"}."""
    have = installed()
    lock = CHECKOUT / LOCKS[lock_kind(have)]
    if not lock.is_file():
        return {"lock": "none: not installed from a checkout's lock"}
    digest = hashlib.sha256(lock.read_bytes()).hexdigest()[:16]
    differs = drift(pins(lock), have)
    return {"lock": f"{LOCKS[lock_kind(have)]} sha256:{digest}",
            "lock_drift": f"{len(differs)}: {', '.join(differs)}" if differs else "none"}
