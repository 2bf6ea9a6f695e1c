"""SIGINT and SIGTERM in each stage of a real `quantgate run`: exit 130 / 143, the run row failed with the
signal and the stage, nothing the run started left running, and the next run resumes the same run.

QUANTGATE_FAULT=<point>=pause holds the process (or, for `measure`, the engine process it spawned) at a
named point, so each signal lands inside the stage it is meant for; the signal itself comes from here,
to the `quantgate` process, as a supervisor's SIGTERM would, or to its whole process group, as a terminal's Ctrl-C
and coreutils `timeout` send it (with Prefect's temporary API server, which must outlive the signal: issue 44).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from quantgate.tasks.runtime.processes import group_alive
from quantgate.warehouse import reads, sessions
from tests.cli_runs import CLI, error_lines, run_cli, run_log
from tests.shared_data import TINY_MODEL
from tests.test_crash_resume import catalog

pytestmark = pytest.mark.slow

# (fault point the run waits at, stage the run row names, signal)
CASES = [("download", "download", signal.SIGINT), ("download", "download", signal.SIGTERM),
         ("quantize", "quantize", signal.SIGINT), ("quantize", "quantize", signal.SIGTERM),
         ("evaluate", "evaluate", signal.SIGINT), ("evaluate", "evaluate", signal.SIGTERM),
         ("measure", "benchmark", signal.SIGINT), ("measure", "benchmark", signal.SIGTERM)]


def _session(sid: int) -> list[psutil.Process]:
    """Processes still alive in session `sid` (the CLI's own session, which its children inherit)."""
    left = []
    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) == sid and p.status() != psutil.STATUS_ZOMBIE:
                left.append(p)
        except (ProcessLookupError, PermissionError, psutil.NoSuchProcess):
            pass
    return left


def wait_paused(proc: subprocess.Popen, paused: Path, point: str) -> None:
    """Until the run's fault point `point` has paused it and noted where (`paused`), failing if the run ends first."""
    deadline = time.monotonic() + 300
    while not (paused.exists() and paused.read_text().strip()):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"never reached {point}"
        time.sleep(0.2)


def interrupt(args: list[str], prefect_api: str, point: str, sig: int, tmp: Path) -> tuple[int, str, list[int]]:
    """Start `quantgate ARGS`, wait until it is paused at `point`, send `sig`: (exit code, stderr, pids paused)."""
    paused = tmp / f"paused-{point}-{sig}"
    env = {**os.environ, "PREFECT_API_URL": prefect_api, "QUANTGATE_FAULT": f"{point}=pause",
           "QUANTGATE_FAULT_PAUSED": str(paused)}
    proc = subprocess.Popen([*CLI, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        wait_paused(proc, paused, point)
        pids = [int(line.split()[1]) for line in paused.read_text().splitlines()]
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
        time.sleep(0.5)  # let the kernel reap what it reparented
        left = _session(proc.pid)
        assert not left, f"left running after {signal.Signals(sig).name}: {[p.cmdline() for p in left]}"
        assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    return proc.returncode, err, pids


def test_interrupted_in_every_stage_fails_the_run_then_resumes(tmp_path, prefect_api):
    if not TINY_MODEL.exists():
        pytest.skip(f"shared tiny model not found at {TINY_MODEL}")
    cat, wh, work = catalog(tmp_path, TINY_MODEL), tmp_path / "w.ducklake", tmp_path / "work"
    args = ["run", "tiny", "-c", str(cat), "-w", str(wh), "--workdir", str(work)]
    run_ids = set()
    for point, stage, sig in CASES:
        code, err, _ = interrupt(args, prefect_api, point, sig, tmp_path)
        name = signal.Signals(sig).name
        assert code == 128 + sig, err
        assert "Traceback" not in err
        assert error_lines(err) == [f"error: interrupted ({name}) during {stage}"], err
        with sessions.session(wh, read_only=True) as con:
            runs = reads.rows(con, "SELECT run_id, status, error FROM runs")
            attempts = reads.rows(con, "SELECT status, error FROM run_attempts ORDER BY started_at")
        assert [(r["status"], r["error"]) for r in runs] == [("failed", f"interrupted ({name}) during {stage}")]
        assert attempts[-1] == {"status": "failed", "error": f"interrupted ({name}) during {stage}"}
        run_ids.add(runs[0]["run_id"])
    assert len(run_ids) == 1  # every rerun resumed the interrupted run

    done = run_cli(args, prefect_api, {"QUANTGATE_FAULT": ""})
    assert done.returncode == 0, done.stderr[-3000:]
    with sessions.session(wh, read_only=True) as con:
        assert reads.rows(con, "SELECT run_id, status FROM runs") == [{"run_id": run_ids.pop(), "status": "completed"}]
        assert con.execute("SELECT count(*) FROM run_attempts").fetchone()[0] == len(CASES) + 1
        assert con.execute("SELECT count(*) FROM decisions").fetchone()[0] == 2


# Signals to the run's process group, as a terminal's Ctrl-C and coreutils `timeout` send them, with Prefect's
# temporary API server (no PREFECT_API_URL), which `quantgate run` starts (issue 44): (fault point, stage the run
# row names, signal, whether the server was killed on its own before the signal).
GROUP_CASES = [("evaluate", "evaluate", signal.SIGINT, False), ("evaluate", "evaluate", signal.SIGTERM, True),
               ("measure", "benchmark", signal.SIGINT, False)]
EXIT_S = 30


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def interrupt_group(args: list[str], point: str, sig: int, kill_server: bool, tmp: Path) -> tuple[int, str, float]:
    """Start `quantgate ARGS` on the temporary API server, wait until it is paused at `point` (after killing its
    server, if asked), send `sig` to its process group: (exit code, stderr, seconds to its exit). Every process the
    run started, and every session it noted in its pidfile, must be gone by then."""
    paused, pidfile = tmp / f"paused-{point}-{sig}", tmp / "sessions.pid"
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update({"PREFECT_HOME": str(tmp / "prefect-home"), "QUANTGATE_FAULT": f"{point}=pause",
                "QUANTGATE_FAULT_PAUSED": str(paused), "QUANTGATE_PIDFILE": str(pidfile)})
    proc = subprocess.Popen([*CLI, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    started: list[psutil.Process] = []
    try:
        wait_paused(proc, paused, point)
        started = psutil.Process(proc.pid).children(recursive=True)
        servers = [p for p in started if "uvicorn" in " ".join(p.cmdline())]
        assert len(servers) == 1, [p.cmdline() for p in started]
        if kill_server:  # gone on its own (by hand, the out-of-memory killer) before the interrupt
            servers[0].kill()
            servers[0].wait(10)
        sent = time.monotonic()
        os.killpg(proc.pid, sig)
        try:
            _, err = proc.communicate(timeout=EXIT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"quantgate run still running {EXIT_S} s after {signal.Signals(sig).name} to its group")
        took = time.monotonic() - sent
        time.sleep(0.5)  # let the kernel reap what it reparented
        left = [p for p in started if not _gone(p.pid)] + _session(proc.pid)
        assert not left, f"left running after {signal.Signals(sig).name}: {[p.cmdline() for p in left]}"
        noted = [int(line) for line in pidfile.read_text().split()] if pidfile.exists() else []
        assert not [pgid for pgid in noted if group_alive(pgid)], "a session the run noted is still running"
    finally:
        for p in started:  # nothing of it survives a failed assertion
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return proc.returncode, err, took


def test_a_signal_to_the_process_group_on_the_temporary_server_exits_at_once_then_resumes(tmp_path):
    """Before issue 44's fix the temporary server died with the group's signal, and the run, its row already
    failed, spent minutes retrying the refused connections and exited 1 ("ConnectError")."""
    if not TINY_MODEL.exists():
        pytest.skip(f"shared tiny model not found at {TINY_MODEL}")
    cat, wh, work = catalog(tmp_path, TINY_MODEL), tmp_path / "w.ducklake", tmp_path / "work"
    args = ["run", "tiny", "-c", str(cat), "-w", str(wh), "--workdir", str(work)]
    run_ids, timings = set(), []
    for point, stage, sig, kill_server in GROUP_CASES:
        code, err, took = interrupt_group(args, point, sig, kill_server, tmp_path)
        name = signal.Signals(sig).name
        timings.append(f"{name} in {stage}{' (server killed)' if kill_server else ''}: {took:.1f} s")
        assert code == 128 + sig, err[-3000:]
        assert "Traceback" not in err
        assert error_lines(err) == [f"error: interrupted ({name}) during {stage}"], err[-3000:]
        # Prefect's API took the crash (before the fix: "Finished in state Running()" after its retries).
        assert "Finished in state Crashed(" in run_log(subprocess.CompletedProcess([], code, "", err))
        with sessions.session(wh, read_only=True) as con:
            runs = reads.rows(con, "SELECT run_id, status, error FROM runs")
        assert [(r["status"], r["error"]) for r in runs] == [("failed", f"interrupted ({name}) during {stage}")]
        run_ids.add(runs[0]["run_id"])
    print("; ".join(timings))
    assert len(run_ids) == 1  # every rerun resumed the interrupted run

    done = run_cli(args, None, {"QUANTGATE_FAULT": "", "PREFECT_HOME": str(tmp_path / "prefect-home")})
    assert done.returncode == 0, done.stderr[-3000:]
    with sessions.session(wh, read_only=True) as con:
        assert reads.rows(con, "SELECT run_id, status FROM runs") == [{"run_id": run_ids.pop(), "status": "completed"}]
        assert con.execute("SELECT count(*) FROM run_attempts").fetchone()[0] == len(GROUP_CASES) + 1
        assert con.execute("SELECT count(*) FROM decisions").fetchone()[0] == 2


@pytest.mark.parametrize("after_s", [1.5, 3.0, 5.0])
def test_a_ctrl_c_before_the_flow_exits_130(tmp_path, after_s):
    """A Ctrl-C while `quantgate run` starts (its warehouse checked, the temporary server booting, the pipeline
    imported), before the flow's guard: one line, 130, nothing left. Typer returned the KeyboardInterrupt's 130, which
    exited 0; a library that wrapped it (DuckDB's "Query interrupted") exited 1."""
    if not TINY_MODEL.exists():
        pytest.skip(f"shared tiny model not found at {TINY_MODEL}")
    cat, wh, work = catalog(tmp_path, TINY_MODEL), tmp_path / "w.ducklake", tmp_path / "work"
    pidfile = tmp_path / "sessions.pid"
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update({"PREFECT_HOME": str(tmp_path / "prefect-home"), "QUANTGATE_PIDFILE": str(pidfile)})
    proc = subprocess.Popen([*CLI, "run", "tiny", "-c", str(cat), "-w", str(wh), "--workdir", str(work)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    started: set[psutil.Process] = set()
    try:
        deadline = time.monotonic() + after_s
        while time.monotonic() < deadline and proc.poll() is None:
            with contextlib.suppress(psutil.NoSuchProcess):
                started |= set(psutil.Process(proc.pid).children(recursive=True))
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=EXIT_S)
        time.sleep(0.5)
        assert proc.returncode == 130, err[-3000:]
        assert len(error_lines(err)) == 1 and error_lines(err)[0].startswith("error: interrupted"), err[-3000:]
        assert not [p.cmdline() for p in started if not _gone(p.pid)]
        noted = [int(line) for line in pidfile.read_text().split()] if pidfile.exists() else []
        assert not [pgid for pgid in noted if group_alive(pgid)], "a session the run noted is still running"
    finally:
        for p in started:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


STUCK = """
import os, signal, threading, time
from quantgate.flows import interrupts
interrupts.EXIT_WITHIN_S = 1.0

def cleanup_that_never_ends():
    threading.Event().wait()

with interrupts.exit_if_stuck():
    try:
        with interrupts.guard():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)
    finally:
        cleanup_that_never_ends()
"""

# A process that goes on after `main` (a test calling it in-process; CI's pytest, which the watchdog once ended
# 25 s after a later test's own interrupt): once `main` is left without an interrupt, an interrupt starts no watchdog.
LIVES_ON = """
import os, signal, time
from quantgate.flows import interrupts
interrupts.EXIT_WITHIN_S = 1.0
with interrupts.exit_if_stuck():
    pass
try:
    with interrupts.guard():
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(30)
except interrupts.Interrupted:
    pass
time.sleep(3)
print("still here")
"""


def test_a_run_whose_cleanup_hangs_after_a_signal_still_exits_with_its_code_and_says_where_it_hung():
    """The CLI's promise to a signal (gone within 30 s, exit 143) holds even when a cleanup on the way out waits
    forever: its stack is printed (what hung, for the fix), then the interrupt's one error line, then the exit."""
    import sys

    done = subprocess.run([sys.executable, "-c", STUCK], capture_output=True, text=True, timeout=60)
    assert done.returncode == 128 + signal.SIGTERM, done.stderr
    assert "still stopping 1 s after SIGTERM" in done.stderr and "cleanup_that_never_ends" in done.stderr
    assert error_lines(done.stderr) == ["error: interrupted (SIGTERM) during startup"], done.stderr
    lives_on = subprocess.run([sys.executable, "-c", LIVES_ON], capture_output=True, text=True, timeout=60)
    assert (lives_on.returncode, lives_on.stdout.strip()) == (0, "still here"), lives_on.stderr[-2000:]


# The main thread blocked in native code that a signal does not interrupt (a futex wait: a second lock of a default
# pthread mutex by its own holder), so Python never runs the guard's handler; ctypes lets go of the GIL meanwhile.
IN_NATIVE_CODE = """
import ctypes, os, signal, threading
from quantgate.flows import interrupts, progress
interrupts.EXIT_WITHIN_S = 1.0
libc = ctypes.CDLL(None)
mutex = ctypes.create_string_buffer(64)  # zeroed: PTHREAD_MUTEX_INITIALIZER on glibc
progress.begin("benchmark", "base")
with interrupts.exit_if_stuck():
    with interrupts.guard():
        libc.pthread_mutex_lock(mutex)
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()
        libc.pthread_mutex_lock(mutex)
"""


def test_a_signal_while_the_main_thread_is_blocked_in_native_code_still_ends_the_run_with_its_code():
    """Python runs a signal's handler only once the main thread is back in Python: blocked in native code it never
    is, and the run would ignore SIGINT and SIGTERM forever. The watchdog reads the signal from the C handler's wakeup
    pipe, so the process still exits with the signal's code, having printed where its threads were and its line."""
    import sys

    done = subprocess.run([sys.executable, "-c", IN_NATIVE_CODE], capture_output=True, text=True, timeout=60)
    assert done.returncode == 128 + signal.SIGTERM, done.stderr[-3000:]
    assert "still stopping 1 s after SIGTERM" in done.stderr and 'File "<string>", line 12' in done.stderr
    assert error_lines(done.stderr) == ["error: interrupted (SIGTERM) during benchmark"], done.stderr[-3000:]


INSIDE_PROGRESS = """
import os, signal, time
from quantgate.flows import interrupts, progress
progress.begin("evaluate", "base")
try:
    with interrupts.guard():
        with progress._lock:  # where the main thread is when the signal lands: the handler reads the same records
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(30)
except interrupts.Interrupted as e:
    print(e)
"""


def test_a_signal_that_lands_inside_the_live_views_lock_is_still_an_interrupt():
    """The handler names the stages in flight from the live view's records, in the main thread, which the signal may
    have stopped inside their lock: it must not wait for itself (a lock it cannot take would hang the run forever)."""
    import sys

    done = subprocess.run([sys.executable, "-c", INSIDE_PROGRESS], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "interrupted (SIGINT) during evaluate", done.stderr[-2000:]
