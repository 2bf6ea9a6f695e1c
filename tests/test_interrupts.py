"""SIGINT and SIGTERM in each stage of a real `quantgate run`: exit 130 / 143, the run row failed with the
signal and the stage, nothing the run started left running, and the next run resumes the same run.

QUANTGATE_FAULT=<point>=pause holds the process (or, for `measure`, the engine process it spawned) at a
named point, so each signal lands inside the stage it is meant for; the signal itself comes from here,
to the `quantgate` process, as a user's Ctrl-C or a supervisor's SIGTERM would.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from quantgate.warehouse import reads, sessions
from tests.cli_runs import CLI, error_lines, run_cli
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


def interrupt(args: list[str], prefect_api: str, point: str, sig: int, tmp: Path) -> tuple[int, str, list[int]]:
    """Start `quantgate ARGS`, wait until it is paused at `point`, send `sig`: (exit code, stderr, pids paused)."""
    paused = tmp / f"paused-{point}-{sig}"
    env = {**os.environ, "PREFECT_API_URL": prefect_api, "QUANTGATE_FAULT": f"{point}=pause",
           "QUANTGATE_FAULT_PAUSED": str(paused)}
    proc = subprocess.Popen([*CLI, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not (paused.exists() and paused.read_text().strip()):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, f"never reached {point}"
            time.sleep(0.2)
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
