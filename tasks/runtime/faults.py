"""Fault injection for the crash-safety tests: QUANTGATE_FAULT makes this process die or wait at a named point.

QUANTGATE_FAULT is a comma-separated list of `point`, `point@n` (die by SIGKILL the n-th time the point
is reached in a process, default the first) or `point[@n]=pause` (stop there until a signal arrives, so that a
test can send SIGINT or SIGTERM while that stage is at work; the point, the pid and where it is (a checkpoint, a
build) are appended as a line to the file named by QUANTGATE_FAULT_PAUSED, and the file `<that file>.<pid>.go`
lets the process go on). Points: `download`, `quantize` (checkpoint written, not yet renamed into place),
`evaluate` (lm-eval finished, nothing stored), `benchmark` (measured, nothing stored), `measure` (inside the
engine process, before it loads) and `write:<stage>` (a stage's rows and its completion mark inserted,
transaction not committed); and, while the GPU holds what they took, `build` (in the build's own process, its
checkpoint written), `evaluate:loaded` (in the lm-eval process, its engine loaded) and `measure:loaded` (in the
engine process, loaded, with the GPU alone, before its passes). Unset, a point costs one dictionary lookup;
nothing in normal operation sets it.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

from quantgate.catalog.settings import settings

_hits: dict[str, int] = {}
_lock = threading.Lock()


def _targets(spec: str) -> dict[str, tuple[int, str]]:
    out = {}
    for item in (s.strip() for s in spec.split(",")):
        if item:
            where, _, action = item.partition("=")
            name, _, nth = where.partition("@")
            out[name] = (int(nth or 1), action or "kill")
    return out


def point(name: str, where: str = "") -> None:
    """Die here (SIGKILL, no cleanup, no finally blocks), or wait for a signal, if QUANTGATE_FAULT asks for this point
    now; `where` tells a test which of the processes reaching it this one is."""
    spec = settings().fault
    if not spec:
        return
    target = _targets(spec).get(name)
    if target is None:
        return
    nth, action = target
    with _lock:
        _hits[name] = _hits.get(name, 0) + 1
        if _hits[name] != nth:
            return
    if action == "pause":
        _pause(f"{name}@{nth}", where)
        return
    print(f"quantgate fault injection: SIGKILL at {name}@{nth} (pid {os.getpid()})", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _pause(label: str, where: str) -> None:
    print(f"quantgate fault injection: paused at {label} (pid {os.getpid()})", file=sys.stderr, flush=True)
    go_on = None
    if path := settings().fault_paused:
        with open(path, "a") as f:
            f.write(f"{label} {os.getpid()} {where}".rstrip() + "\n")
        go_on = Path(f"{path}.{os.getpid()}.go")
    # A signal handler's exception, or the signal's default action, ends the wait; so does the test's go file (an
    # engine core it killed meanwhile).
    while go_on is None or not go_on.exists():
        time.sleep(0.1)
