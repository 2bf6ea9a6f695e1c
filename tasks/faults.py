"""Fault injection for the crash-safety tests: QUANTGATE_FAULT makes this process SIGKILL itself at a named point.

QUANTGATE_FAULT is a comma-separated list of `point` or `point@n` (die at the n-th time the point is
reached, default the first). Points: `download`, `quantize` (checkpoint written, not yet renamed into
place), `evaluate` (lm-eval finished, nothing stored), `benchmark` (measured, nothing stored) and
`write:<stage>` (a stage's rows and its completion mark inserted, transaction not committed). Unset, a
point costs one dictionary lookup; nothing in normal operation sets it.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

ENV = "QUANTGATE_FAULT"
_hits: dict[str, int] = {}
_lock = threading.Lock()


def _targets(spec: str) -> dict[str, int]:
    out = {}
    for item in (s.strip() for s in spec.split(",")):
        if item:
            name, _, nth = item.partition("@")
            out[name] = int(nth or 1)
    return out


def point(name: str) -> None:
    """Die here (SIGKILL, no cleanup, no finally blocks) if QUANTGATE_FAULT asks for this point now."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    nth = _targets(spec).get(name)
    if nth is None:
        return
    with _lock:
        _hits[name] = _hits.get(name, 0) + 1
        if _hits[name] != nth:
            return
    print(f"quantgate fault injection: SIGKILL at {name}@{nth} (pid {os.getpid()})", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)
