"""Cancelling a run and stopping a worker, against the real PostgreSQL, `prefect server`, `quantgate deploy` and process
workers of tests/test_deployment.py (its `deployed` fixture: a server of this module's own).

A run of evaluate-model cancelled from Prefect (`prefect flow-run cancel`, as the UI does: its state set to
Cancelling) while it evaluates its base ends Cancelled: no Crashed state, no AwaitingRetry from `quantgate deploy`'s
retry automation, no second start on an idle host; its process and what it started are gone, and its warehouse row
says cancelled, with the stage. Then a worker told SIGTERM is gone within 10 s, idle or with a run in flight; the
run goes with it unannounced (Prefect's worker ends it at once), left to the heartbeat automation.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests import prefect_server
from tests.test_deployment import (  # noqa: F401 - `deployed` is a fixture
    Hosts, attempts, client, deployed, submit, wait_paused)

pytestmark = pytest.mark.slow

# How long an idle host is given to start the cancelled run again, were it scheduled again: the retry automation
# acts within seconds of a Crashed state, and the hosts ask for work every 2 s (PREFECT_WORKER_QUERY_SECONDS).
GRACE_S = 20


def _alive(pids: list[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def test_a_run_cancelled_from_prefect_ends_cancelled_and_is_not_started_again(deployed):
    paused = deployed["tmp"] / "paused-cancel.txt"
    model = str(deployed["models"]["stories260k-b"])
    hosts = Hosts(deployed)
    # host-x takes the run and holds it in its base's evaluation; host-y stays idle, where a retry would start.
    hosts.start("host-x", QUANTGATE_FAULT="evaluate=pause", QUANTGATE_FAULT_PAUSED=str(paused))
    try:
        run_id = submit(deployed, model)
        pid = wait_paused(paused, hosts)
        hosts.start("host-y")
        started = [pid, *(p.pid for p in psutil.Process(pid).children(recursive=True))]
        [row] = attempts(deployed, "stories260k-b")
        assert (row["run_id"], row["run_status"], row["status"], row["host"]) == (run_id, "running", "running",
                                                                                  "host-x")
        with client(deployed["url"]) as c:
            assert c.read_flow_run(run_id).state.is_running()
        cancel = subprocess.run([sys.executable, "-m", "prefect", "flow-run", "cancel", run_id], env=deployed["env"],
                                capture_output=True, text=True, timeout=120)
        assert cancel.returncode == 0, cancel.stdout + cancel.stderr
        cancelled_at = time.monotonic()
        with client(deployed["url"]) as c:
            while not c.read_flow_run(run_id).state.is_final() and time.monotonic() - cancelled_at < 120:
                time.sleep(1)
            ended_s = time.monotonic() - cancelled_at
            time.sleep(GRACE_S)  # an idle host, and the automations, have time to start it again
            run = c.read_flow_run(run_id)
            states = [(s.type.value, s.name, s.message) for s in c.read_flow_run_states(run_id)]
        left = _alive(started)
    finally:
        hosts.stop_all()
    assert run.state.is_cancelled(), f"{states}\n{hosts.logs()}"
    assert ended_s < 60, states  # the worker's SIGTERM, the run's cleanup (10 s at most), the state
    after = [t for t, _, _ in states[[t for t, _, _ in states].index("CANCELLING"):]]
    assert set(after) == {"CANCELLING", "CANCELLED"}, states  # no Crashed, AwaitingRetry or second Running
    assert [t for t, _, _ in states].count("RUNNING") == 1, states
    assert run.run_count == 1, states
    assert not left, f"still running after the cancel: {left}"
    [row] = attempts(deployed, "stories260k-b")  # no second attempt, here or on host-y
    assert (row["run_id"], row["run_status"], row["status"]) == (run_id, "cancelled", "cancelled")
    from quantgate.warehouse import sessions

    with sessions.session(deployed["wh"], read_only=True) as con:
        [(error, finished)] = con.execute("SELECT error, finished_at FROM runs WHERE run_id = ?", [run_id]).fetchall()
    assert error == "cancelled from Prefect during evaluate" and finished is not None
    # The Cancelled state carries the same reason (the worker then confirms it with its own message).
    assert ("CANCELLED", "Cancelled", "cancelled from Prefect during evaluate") in states, states


def test_a_worker_told_sigterm_is_gone_within_10_s(deployed):
    """SIGTERM to an idle worker's pid (`kill <pid>`): it exits within 10 s."""
    worker = prefect_server.start(
        [sys.executable, "-m", "prefect", "worker", "start", "--pool", "quantgate-gpu", "--type", "process",
         "--limit", "1", "--name", "host-z"], {**deployed["env"], "QUANTGATE_HOST": "host-z"},
        deployed["tmp"] / "worker-host-z.log", cwd=deployed["tmp"])
    try:
        with client(deployed["url"]) as c:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and "host-z" not in {w.name for w in c.read_workers_for_work_pool(
                    "quantgate-gpu") if w.status.value == "ONLINE"}:
                time.sleep(1)
        assert worker.poll() is None, (deployed["tmp"] / "worker-host-z.log").read_text()[-3000:]
        told = time.monotonic()
        os.kill(worker.pid, signal.SIGTERM)
        try:
            code = worker.wait(10)
        except subprocess.TimeoutExpired:
            log = (deployed["tmp"] / "worker-host-z.log").read_text()
            pytest.fail(f"worker alive 10 s after SIGTERM: {log[-3000:]}")
        assert time.monotonic() - told < 10 and code == 0
    finally:
        prefect_server.stop(worker)


def test_a_worker_told_sigterm_mid_run_is_gone_within_10_s_and_takes_its_run_with_it(deployed):
    """What is true of stopping a host's worker while it runs a model: the worker is gone within 10 s, and Prefect's
    worker ends the run's process as it goes (SIGTERM, then SIGKILL at once), so the run's own cleanup does not
    happen: its warehouse row still says running and its Prefect state Running, until the heartbeat automation
    crashes it (90 s) and the retry automation starts it again on another host (tests/test_deployment.py)."""
    paused = deployed["tmp"] / "paused-stop.txt"
    hosts = Hosts(deployed)
    hosts.start("host-s", QUANTGATE_FAULT="evaluate=pause", QUANTGATE_FAULT_PAUSED=str(paused))
    worker = hosts.workers["host-s"]
    try:
        run_id = submit(deployed, str(deployed["models"]["stories260k-c"]))
        pid = wait_paused(paused, hosts)
        told = time.monotonic()
        os.kill(worker.pid, signal.SIGTERM)
        try:
            code = worker.wait(10)
        except subprocess.TimeoutExpired:
            pytest.fail(f"worker alive 10 s after SIGTERM, its run in flight:\n{hosts.logs()}")
        gone_s = time.monotonic() - told
        while _alive([pid]) and time.monotonic() - told < 10:
            time.sleep(0.2)
        left = _alive([pid])
        with client(deployed["url"]) as c:
            state = c.read_flow_run(run_id).state
        [row] = attempts(deployed, "stories260k-c")
    finally:
        hosts.stop_all()
    assert gone_s < 10 and code == 0
    assert not left, "the run's process outlived its worker"
    assert state.is_running(), state
    assert (row["run_id"], row["run_status"], row["status"]) == (run_id, "running", "running")
