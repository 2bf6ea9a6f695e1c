"""A real process standing for an engine process a speed backend starts (what launch.start_then_measure takes): it
leads a session of its own, runs at the niceness it was started at, and is stopped on leaving its context."""

from __future__ import annotations

import os
import subprocess


class EngineProcess:
    def __init__(self, cmd: list[str], niceness: int, **popen: object) -> None:
        self.proc = subprocess.Popen(cmd, start_new_session=True,
                                     preexec_fn=(lambda: os.nice(niceness)) if niceness else None, **popen)
        self.pid = self.proc.pid

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.kill()
        self.proc.wait()
