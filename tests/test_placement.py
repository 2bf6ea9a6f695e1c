"""A pool run's place on its host, against a real Prefect server: the host's GPUs as global concurrency limits of one
slot each, taken all at once or not at all; a model's limit that makes the same model wait; a run that needs more
GPUs than the host has fails in one line. Each run is a process of its own, as a flow run on a worker is. The GPUs
are names here (CUDA_VISIBLE_DEVICES=0,1 on a machine without them): nothing touches CUDA; the H200 runs the same
code through the deployments (benchmarks/gpu/deploy.sh)."""

from __future__ import annotations

import os
import selectors
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

# Holds its place until a line arrives on stdin; prints the GPUs it holds (or the error line) as soon as it has them.
RUN = """
import os, sys
from quantgate.tasks.runtime import placement
try:
    with placement.placed(sys.argv[1], int(sys.argv[2])) as where:
        print("held", ",".join(where.gpus), os.environ["CUDA_VISIBLE_DEVICES"], flush=True)
        sys.stdin.readline()
except placement.PlacementError as e:
    print("error", e, flush=True)
"""


class Run:
    def __init__(self, url: str, model: str, gpus: int) -> None:
        env = {**os.environ, "PREFECT_API_URL": url, "CUDA_VISIBLE_DEVICES": "0,1", "QUANTGATE_HOST": "gpu-host"}
        self.proc = subprocess.Popen([sys.executable, "-c", RUN, model, str(gpus)], env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)

    def said(self, timeout_s: float) -> str | None:
        """Its line, or None when it says nothing for `timeout_s` (it waits for its place)."""
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            if not sel.select(timeout_s):
                return None
        return self.proc.stdout.readline().strip()

    def release(self) -> None:
        self.proc.stdin.write("done\n")
        self.proc.stdin.flush()
        assert self.proc.wait(60) == 0


def test_gpus_are_taken_whole_and_a_model_waits_for_itself(prefect_api):
    runs: list[Run] = []

    def start(model: str, gpus: int) -> Run:
        runs.append(Run(prefect_api, model, gpus))
        return runs[-1]

    try:
        one = start("model-a", 1)
        assert one.said(60) == "held 0 0"
        two = start("model-b", 1)
        assert two.said(60) == "held 1 1"  # the other GPU, seen alone
        both = start("model-c", 2)
        assert both.said(8) is None  # needs two: waits while either is held
        one.release()
        assert both.said(8) is None
        two.release()
        assert both.said(60) == "held 0,1 0,1"
        again = start("model-c", 1)
        assert again.said(8) is None  # the same model: waits for the run holding its limit, not for a GPU
        both.release()
        assert again.said(60) == "held 0 0"
        again.release()
        too_many = start("model-d", 3)
        assert too_many.said(60) == "error model-d needs 3 GPUs; host gpu-host has 2 (0,1)"
    finally:
        for run in runs:
            if run.proc.poll() is None:
                run.proc.kill()
