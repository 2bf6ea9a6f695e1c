"""The processes of vLLM's command line (`vllm serve`, `vllm bench`): each in its own session, so that ending
its process group also ends the children it spawned (vLLM's engine core and workers), and noted by id."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from quantgate.catalog.settings import settings
from quantgate.tasks.adapters.speed.vllm_cli import QUIET_ENV


def spawn_session(cmd: Sequence[str], log: Path, env: dict[str, str] | None, append: bool = False,
                  niceness: int = 0, pass_fds: Sequence[int] = ()) -> subprocess.Popen:
    """Start `cmd` in its own session (so its whole group can be ended by id), output to `log`, at `niceness`
    (through nice(1), which execs the command: the session leader is still the command), with the file
    descriptors `pass_fds` kept open in it."""
    if niceness:
        cmd = ["nice", "-n", str(niceness), *cmd]
    with log.open("ab" if append else "wb") as log_file:
        proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
            env=_environment(env), start_new_session=True, pass_fds=tuple(pass_fds),
        )
    _note_session(proc.pid)
    return proc


# A file to which every session this module starts appends its id (= the leader's pid), so that a
# wrapper that must stop a run abruptly can still end those sessions by id (benchmarks/gpu/run_suite.sh).


def _note_session(pid: int) -> None:
    if path := settings().pidfile:
        with open(path, "a") as f:
            f.write(f"{pid}\n")


def _environment(extra: dict[str, str] | None) -> dict[str, str]:
    env = {**QUIET_ENV, **os.environ}
    env.update(extra or {})
    return env


def end_group(proc: subprocess.Popen, grace_s: float) -> None:
    # start_new_session made the child a group leader: its pid is the group id.
    pgid = proc.pid
    if proc.poll() is not None and not group_alive(pgid):
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace_s)
    # The leader may be gone while children it spawned still run in the group.
    while time.monotonic() < deadline and group_alive(pgid):
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
    proc.wait()


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def log_tail(path: Path, lines: int = 5) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "(no log)"
    return " | ".join(text[-lines:]) or "(empty log)"

