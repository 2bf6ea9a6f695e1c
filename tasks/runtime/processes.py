"""Processes a run starts and stops outside tasks/runtime/launch.py's spawned Python workers: a command in a
session of its own (`vllm serve`, `vllm bench`, Prefect's temporary API server), so that ending its process group
also ends the children it spawned (vLLM's engine core and workers), noted by id; a child run to its end that says
when its model has loaded (the lm-eval process); and, on an interrupt, every process group a run started
(flows/interrupts.py). Each process started here, and each worker tasks/runtime/launch.py spawns, ends by itself
when the process that started it dies without cleaning up (`kill -9`, the out-of-memory killer): die_with_parent."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import FrameType

import psutil

from quantgate.catalog.settings import settings


_PR_SET_PDEATHSIG = 1


def _libc_prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None  # no parent-death signal elsewhere (macOS has none): a killed parent leaves its children running
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    return prctl


# Looked up once, here: die_with_parent also runs as a Popen preexec_fn, between fork and exec, where it should do
# no more than the system call.
_PRCTL = _libc_prctl()


def die_with_parent(parent_pid: int, sig: int = signal.SIGTERM) -> None:
    """Have this process sent `sig` when its parent dies, however it dies (`kill -9` included: Linux's
    PR_SET_PDEATHSIG; a no-op elsewhere), and end it now if its parent, `parent_pid`, died before this call.

    Called in the child: as a Popen preexec_fn (the setting survives the exec, nice(1)'s too), or first thing in a
    spawned worker. Caveat: the kernel sends the signal when the *thread* that started the child ends, not its
    process; every caller here starts its child from a thread that waits for that child to end."""
    if _PRCTL is None:
        return
    _PRCTL(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent died first: reparented, and no signal is coming
        os._exit(128 + int(sig))


def _with_parent() -> Callable[[], None]:
    """A preexec_fn: the child gets SIGTERM when this process dies (die_with_parent)."""
    return functools.partial(die_with_parent, os.getpid())


# How long a process told SIGTERM by exit_on_sigterm's handler has for its cleanup before it ends in any case.
SIGTERM_GRACE_S = 20


def exit_on_sigterm(grace_s: int = SIGTERM_GRACE_S) -> None:
    """In this process's main thread, SIGTERM (its parent's death: die_with_parent) raises SystemExit(143) where the
    process is, so that its `finally` blocks and exit handlers end the engines and servers it started, which
    SIGTERM's default action would leave running. Once only: a second SIGTERM does not cut that cleanup short.
    Should the cleanup hang, SIGALRM's default action ends the process `grace_s` later (where SIGALRM is not
    otherwise in use)."""
    fired: list[int] = []

    def handle(signum: int, frame: FrameType | None) -> None:
        if fired:
            return
        fired.append(signum)
        if grace_s and signal.getsignal(signal.SIGALRM) == signal.SIG_DFL:
            signal.alarm(grace_s)
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handle)


# Sessions started as services this process uses to its very end (Prefect's temporary API server): an interrupt's
# stop_started spares them, and whoever started one stops it. By session id and its leader's start time: once a
# service has ended, a later session given the same id is not spared.
_services: dict[int, float] = {}


def _is_service(pgid: int) -> bool:
    """Whether the session `pgid` is a service this process started and which still runs (the same leader)."""
    started = _services.get(pgid)
    if started is None:
        return False
    try:
        if psutil.Process(pgid).create_time() == started:
            return True
    except psutil.NoSuchProcess:
        pass
    del _services[pgid]  # it ended: its id may name another session now
    return False


def spawn_session(cmd: Sequence[str], log: Path | None, env: Mapping[str, str] | None, append: bool = False,
                  niceness: int = 0, pass_fds: Sequence[int] = (),
                  defaults: Mapping[str, str] | None = None, service: bool = False) -> subprocess.Popen:
    """Start `cmd` in its own session (so its whole group can be ended by id, and a signal to this process's group,
    a terminal's Ctrl-C or coreutils `timeout`'s, does not reach it), output to `log` (None: where this process's
    goes), at `niceness` (through nice(1), which execs the command: the session leader is still the command), with
    the file descriptors `pass_fds` kept open in it. Its environment: `defaults` (which this process's own variables
    override), this process's, then `env`. It gets SIGTERM should this process die (die_with_parent), which `vllm
    serve` takes as a shutdown, its engine's included. A `service` is spared by stop_started."""
    if niceness:
        cmd = ["nice", "-n", str(niceness), *cmd]
    with log.open("ab" if append else "wb") if log else contextlib.nullcontext() as log_file:
        proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT if log_file else None,
            env={**(defaults or {}), **os.environ, **(env or {})}, start_new_session=True, pass_fds=tuple(pass_fds),
            preexec_fn=_with_parent(),
        )
    _note_session(proc.pid)
    if service:
        with contextlib.suppress(psutil.NoSuchProcess):  # one that ended at once is no service to spare
            _services[proc.pid] = psutil.Process(proc.pid).create_time()
    return proc


# A file to which every session this module starts appends its id (= the leader's pid), so that a
# wrapper that must stop a run abruptly can still end those sessions by id (benchmarks/gpu/run_suite.sh).


def _note_session(pid: int) -> None:
    if path := settings().pidfile:
        with open(path, "a") as f:
            f.write(f"{pid}\n")


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


def run_to_end(cmd: Sequence[str], env: Mapping[str, str], ready: Path, on_ready: Callable[[], None],
               poll_s: float) -> int:
    """Run `cmd` to its end; once it has written the file `ready` (its model loaded), call `on_ready`. An exception
    here (an interrupt) kills it, and so does this process's death (SIGTERM: die_with_parent). Returns its exit
    code."""
    proc = subprocess.Popen(list(cmd), env=dict(env), preexec_fn=_with_parent())
    try:
        while not ready.exists():
            try:
                proc.wait(timeout=poll_s)
                return proc.returncode  # ended before it was ready
            except subprocess.TimeoutExpired:
                pass
        on_ready()
        proc.wait()  # its end, as it comes, not at the next poll
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc.returncode


def stop_started(parent: psutil.Process, before: set[int], grace_s: float) -> None:
    """SIGTERM each process group that holds a descendant of `parent` started after `before` was taken (the
    parent's own group: those processes only), then SIGKILL what is left after `grace_s`. Services (spawn_session's
    `service`) are spared, and so is multiprocessing's resource tracker, which ignores SIGTERM (a wait of `grace_s`
    for nothing) and ends by itself when this process exits, after it has freed what the spawned workers leaked."""
    try:
        started = [p for p in parent.children(recursive=True) if p.pid not in before]
    except psutil.NoSuchProcess:
        return
    own = os.getpgrp()
    tracker = _resource_tracker()
    groups, loose, spared = set(), [], []
    for p in started:
        with contextlib.suppress(psutil.NoSuchProcess, ProcessLookupError):
            pgid = os.getpgid(p.pid)
            if _is_service(pgid) or p.pid == tracker:
                spared.append(p)
            else:
                (loose.append(p) if pgid == own else groups.add(pgid))
    started = [p for p in started if p not in spared]
    _signal_all(groups, loose, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_running(p) for p in started):
        time.sleep(0.1)
    _signal_all(groups, [p for p in loose if _running(p)], signal.SIGKILL)
    psutil.wait_procs(loose, timeout=5)


def _resource_tracker() -> int | None:
    """The pid of this process's multiprocessing resource tracker, if it started one."""
    if "multiprocessing.resource_tracker" not in sys.modules:
        return None
    return getattr(sys.modules["multiprocessing.resource_tracker"]._resource_tracker, "_pid", None)


def _signal_all(groups: set[int], loose: list[psutil.Process], sig: int) -> None:
    for pgid in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)
    for p in loose:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.send_signal(sig)


def _running(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
