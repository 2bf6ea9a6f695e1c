"""Fault injection for the crash-safety tests: QUANTGATE_FAULT makes this process die or wait at a named point.

QUANTGATE_FAULT is a comma-separated list of `point`, `point@n` (die by SIGKILL the n-th time the point
is reached, default the first) or `point[@n]=pause` (stop there until a signal arrives, so that a test can
send SIGINT or SIGTERM while that stage is at work; the point and the pid are appended to the file named by
QUANTGATE_FAULT_PAUSED). Points: `download`, `quantize` (checkpoint written, not yet renamed into place),
`evaluate` (lm-eval finished, nothing stored), `benchmark` (measured, nothing stored), `measure` (inside the
engine process, before it measures) and `write:<stage>` (a stage's rows and its completion mark inserted,
transaction not committed). Unset, a point costs one dictionary lookup; nothing in normal operation sets it.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

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


def point(name: str) -> None:
    """Die here (SIGKILL, no cleanup, no finally blocks), or wait for a signal, if QUANTGATE_FAULT asks for this point now."""
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
        _pause(f"{name}@{nth}")
        return
    print(f"quantgate fault injection: SIGKILL at {name}@{nth} (pid {os.getpid()})", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _pause(label: str) -> None:
    print(f"quantgate fault injection: paused at {label} (pid {os.getpid()})", file=sys.stderr, flush=True)
    if path := settings().fault_paused:
        with open(path, "a") as f:
            f.write(f"{label} {os.getpid()}\n")
    while True:  # a signal handler's exception, or the signal's default action, ends the wait
        time.sleep(0.1)
