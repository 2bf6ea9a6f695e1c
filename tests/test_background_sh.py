"""benchmarks/gpu/background.sh, the device's way to outlive one call: `start` returns while its job runs, even
when its output is piped (a device call that pipes it would otherwise wait for the job), and `wait` brings back
the job's exit code and files. Runs the real script on this machine with a scratch jobs folder."""

from __future__ import annotations

import subprocess
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu" / "background.sh"


def _env(tmp_path: Path) -> dict[str, str]:
    import os

    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    return {**os.environ, "QG_JOBS": str(tmp_path / "jobs"), "OUT": str(out)}


def test_start_returns_through_a_pipe_while_the_job_runs_and_wait_collects_it(tmp_path):
    env = _env(tmp_path)
    gate = tmp_path / "gate"
    # The job holds until this test opens the gate: when `start` returns, the job is certainly still running.
    job = f'while [ ! -e {gate} ]; do sleep 0.1; done; echo "$OUT" > "$OUT/where.txt"; echo finished'
    started = subprocess.run(["bash", "-c", f"bash {SCRIPT} start j1 '{job}' | tail -n 1"], env=env, cwd=REPO,
                             capture_output=True, text=True, timeout=120)
    assert started.returncode == 0, started.stderr
    assert "background: started j1" in started.stdout
    jobdir = tmp_path / "jobs" / "j1"
    assert not (jobdir / "rc").exists()  # still waiting on the gate

    gate.touch()
    waited = subprocess.run(["bash", str(SCRIPT), "wait", "60", "j1"], env=env, cwd=REPO, capture_output=True,
                            text=True, timeout=120)
    assert "== j1: ended, exit 0" in waited.stdout and "finished" in waited.stdout
    assert (jobdir / "out" / "where.txt").read_text().strip() == str(jobdir / "out")
    with tarfile.open(tmp_path / "out" / "j1.tar.gz") as tar:
        names = tar.getnames()
    assert "./rc" in names and "./out/where.txt" in names and not any(n.startswith("./repo") for n in names)


def test_stop_ends_a_running_job_and_its_children_and_keeps_what_it_wrote(tmp_path):
    env = _env(tmp_path)
    # A job with a child of its own that would run for minutes: stop must end both, not only the shell.
    job = 'echo begun > "$OUT/begun.txt"; sleep 300 & wait'
    started = subprocess.run(["bash", str(SCRIPT), "start", "long", job], env=env, cwd=REPO, capture_output=True,
                             text=True, timeout=60)
    assert "background: started long" in started.stdout
    jobdir = tmp_path / "jobs" / "long"
    for _ in range(100):
        if (jobdir / "out" / "begun.txt").exists():
            break
        import time

        time.sleep(0.1)
    pid = int((jobdir / "pid").read_text())
    stopped = subprocess.run(["bash", str(SCRIPT), "stop", "long"], env=env, cwd=REPO, capture_output=True, text=True,
                             timeout=60)
    assert "background: long stopped" in stopped.stdout and (jobdir / "rc").exists()
    # Nothing of the job's process group is left.
    left = subprocess.run(["pgrep", "-g", str(pid)], capture_output=True, text=True)
    assert left.stdout.strip() == ""
    assert (jobdir / "out" / "begun.txt").read_text().strip() == "begun"
