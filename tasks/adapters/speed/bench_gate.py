"""`vllm bench throughput` with its start apart from its passes, and its timed pass repeated: the bench's program, as
`python -m quantgate.tasks.adapters.speed.bench_gate bench throughput ...`, which is vLLM's own command line with two
changes to how `vllm.LLM.generate` is called, not to what it does:

- the benchmark's first `generate` (its warm-up pass; the timed pass follows it) waits until it is told to go. So the
  engine's start (imports, engine core, compile, CUDA graphs: 82 s of the 105 s window the bench held in reference5)
  can share the GPU with unmeasured work like every other engine's, while the passes the bench times have it alone;
- its timed `generate` runs `passes` times back to back with the same prompts and sampling parameters, each timed
  with `time.perf_counter` around the call as vLLM's `run_vllm` times its one pass, the seconds written to a file
  with where the CPU went meanwhile (telemetry.PassClocks, as our passes record it).
  One pass of a CPU-bound configuration moves by 5-20 % from one pass to the next (results/h200/README.md,
  reference6), so the bench is held against our repetitions with repetitions of its own. The bench's own
  `elapsed_time` then covers all of them.

With GATE_ENV set to "READY_FD,GO_FD,TIMED_CALL,PASSES,TIMES_FILE" (pipe ends the parent passed down; the number of
the timed `generate` call, 2 after a warm-up, else 1), the process writes one line to READY_FD when it reaches its
first call and reads one from GO_FD: "go" lets it run, end of file (its parent gone) ends it. Without GATE_ENV it is
vLLM's command line as it is. Only the standard library (and tasks/runtime/telemetry.py, which imports nothing else at
load) is imported before vLLM: this runs in the bench's process, not in quantgate's.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

from quantgate.catalog.settings import settings
from quantgate.tasks.runtime.telemetry import PassClocks

GATE_ENV = "QUANTGATE_BENCH_GATE"
READY = b"ready\n"
GO = b"go\n"


def gate_env(ready_fd: int, go_fd: int, timed_call: int, passes: int, times_file: str) -> str:
    return f"{ready_fd},{go_fd},{timed_call},{passes},{times_file}"


def gate_generate(ready_fd: int, go_fd: int, timed_call: int, passes: int, times_file: str) -> None:
    """Make vllm.LLM's first generate call wait for the parent's go, and its `timed_call`-th run `passes` times (see
    the module)."""
    from vllm import LLM

    generate = LLM.generate
    calls = 0

    def gated(self: Any, *args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:
            os.write(ready_fd, READY)
            os.close(ready_fd)
            with os.fdopen(go_fd, "rb") as go:
                if go.readline() != GO:
                    raise SystemExit("bench gate: no go from the parent (it ended); the passes were not run")
        if calls != timed_call:
            return generate(self, *args, **kwargs)
        timed = []
        for _ in range(passes):
            with PassClocks() as clocks:
                began = time.perf_counter()
                outputs = generate(self, *args, **kwargs)
                seconds = time.perf_counter() - began
            timed.append({"seconds": seconds, **clocks.figures()})
        with open(times_file, "w") as f:
            json.dump(timed, f)
        return outputs

    LLM.generate = gated  # type: ignore[method-assign]


def main() -> None:
    # Removed, so that the engine core and workers the bench spawns do not see it.
    if gate := settings().bench_gate:
        os.environ.pop(GATE_ENV, None)
        ready_fd, go_fd, timed_call, passes, times_file = gate.split(",", 4)
        gate_generate(int(ready_fd), int(go_fd), int(timed_call), int(passes), times_file)
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *sys.argv[1:]]
    vllm_main()


if __name__ == "__main__":
    main()
