"""A run's process killed outright (`kill -9`, issue 44 item 2): what it started ends by itself. A real parent
process (`parent` below, run with -c) starts, through the real functions, a session (spawn_session, as `vllm serve`
is), a child run to its end (run_to_end, as the lm-eval process is), a spawned worker (launch.on_gpus) and a spawned
group leader (launch.in_process_group); each worker starts an "engine" of its own with plain Popen, as vLLM starts
its engine core, and ends it in a `finally` block. Once every pid is known the parent gets SIGKILL; every one of
those processes must be gone within 10 s, and the workers' `finally` blocks must have run."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from quantgate.tasks.runtime import launch, processes

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal: Linux only")

REPO = Path(__file__).resolve().parents[1]
# Writes its pid to argv[1], then sleeps: a server, a bench, an lm-eval process, an engine core.
SLEEPER = "import os, sys, time; open(sys.argv[1] + '.tmp', 'w').write(str(os.getpid())); " \
          "os.rename(sys.argv[1] + '.tmp', sys.argv[1]); time.sleep(600)"


def _sleeper(pid_file: Path) -> list[str]:
    return [sys.executable, "-c", SLEEPER, str(pid_file)]


def _write(path: Path, text: str) -> None:
    path.with_suffix(".tmp").write_text(text)
    path.with_suffix(".tmp").rename(path)


def worker(out: str, name: str) -> None:
    """A spawned worker's life: it starts an engine (plain Popen, no parent-death signal of its own) and, in its
    `finally`, ends it, as a vLLM engine's shutdown ends its engine core."""
    folder = Path(out)
    engine = subprocess.Popen(_sleeper(folder / f"{name}-engine.pid"))
    _write(folder / f"{name}.pid", str(os.getpid()))
    try:
        time.sleep(600)
    finally:
        engine.terminate()
        engine.wait()
        _write(folder / f"{name}.cleaned", "yes")


def parent(out: str) -> None:
    """The run's process: everything started, each from a thread that waits for it, as a run does."""
    folder = Path(out)
    processes.spawn_session(_sleeper(folder / "session.pid"), folder / "session.log", None)
    to_end = (_sleeper(folder / "to_end.pid"), dict(os.environ), folder / "never", lambda: None, 1.0)
    threading.Thread(target=processes.run_to_end, args=to_end, daemon=True).start()
    threading.Thread(target=launch.in_process_group, daemon=True,
                     args=(worker, (out, "group"), 600, folder / "group.log")).start()
    launch.on_gpus(None, None, worker, out, "gpus")


PIDS = ["session", "to_end", "group", "group-engine", "gpus", "gpus-engine"]


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE  # not reaped (pid 1 may not reap): ended
    except psutil.NoSuchProcess:
        return True


def test_a_parent_killed_outright_leaves_nothing_running(tmp_path):
    run_parent = f"from tests.test_parent_death import parent; parent({str(tmp_path)!r})"
    proc = subprocess.Popen([sys.executable, "-c", run_parent], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    pids: dict[str, int] = {}
    try:
        deadline = time.monotonic() + 120  # spawned workers import quantgate: slow on a busy machine
        while len(pids) < len(PIDS):
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < deadline, f"only {sorted(pids)} started"
            pids = {n: int((tmp_path / f"{n}.pid").read_text()) for n in PIDS if (tmp_path / f"{n}.pid").exists()}
            time.sleep(0.1)
        assert all(psutil.pid_exists(p) for p in pids.values())

        proc.kill()
        proc.wait()
        killed = time.monotonic()
        while time.monotonic() - killed < 10 and not all(_gone(p) for p in pids.values()):
            time.sleep(0.1)
        left = {n: p for n, p in pids.items() if not _gone(p)}
        assert not left, f"still running 10 s after the parent's SIGKILL: {left}"
        # The workers ended what they started on the way out (SIGTERM raised SystemExit in them).
        assert (tmp_path / "gpus.cleaned").exists() and (tmp_path / "group.cleaned").exists()
    finally:
        for p in pids.values():
            if not _gone(p):
                os.kill(p, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_child_whose_parent_died_before_it_asked_ends_at_once():
    """The race die_with_parent closes: the parent gone before the child set its parent-death signal (here a pid
    that is not its parent stands for the one it had), the child ends instead of running on."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                             preexec_fn=functools.partial(processes.die_with_parent, os.getppid()))
    try:
        assert child.wait(timeout=10) == 128 + signal.SIGTERM
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_a_worker_whose_cleanup_hangs_after_sigterm_still_ends():
    """exit_on_sigterm's last resort: SIGTERM raises SystemExit, the `finally` block hangs, SIGALRM ends the process
    `grace_s` later (so a worker whose parent died cannot hold the GPU for good)."""
    code = ("import time; from quantgate.tasks.runtime import processes; processes.exit_on_sigterm(grace_s=1)\n"
            "try:\n    print('ready', flush=True); time.sleep(600)\n"
            "finally:\n    print('cleanup', flush=True); time.sleep(600)")
    child = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        child.send_signal(signal.SIGTERM)
        assert child.stdout.readline().strip() == "cleanup"  # SIGTERM raised: the finally block runs
        assert child.wait(timeout=10) == -signal.SIGALRM
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
