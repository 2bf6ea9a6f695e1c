"""`vllm bench throughput` with its start apart from its passes: the bench's program, as
`python -m quantgate.tasks.speed.bench_gate bench throughput ...`, which is vLLM's own command line with one
hold: the benchmark's first `LLM.generate` (its warm-up pass; the timed pass follows it) waits until it is told
to go. So the engine's start (imports, engine core, compile, CUDA graphs: 82 s of the 105 s window the bench held
in reference5) can share the GPU with unmeasured work like every other engine's, while the passes the bench
times have the GPU alone. The bench's own code loads, warms up and times; nothing of it is changed.

With GATE_ENV set to "READY_FD,GO_FD" (pipe ends the parent passed down), the process writes one line to
READY_FD when it reaches its first pass and reads one from GO_FD: "go" lets it run, end of file (its parent
gone) ends it. Without GATE_ENV it is vLLM's command line as it is. Only the standard library is imported
before vLLM: this runs in the bench's process, not in quantgate's.
"""

from __future__ import annotations

import os
import sys
from typing import Any

GATE_ENV = "QUANTGATE_BENCH_GATE"
READY = b"ready\n"
GO = b"go\n"


def hold_first_generate(ready_fd: int, go_fd: int) -> None:
    """Make vllm.LLM's first generate call wait for the parent's go (see the module)."""
    from vllm import LLM

    generate = LLM.generate
    held = False

    def gated(self: Any, *args: Any, **kwargs: Any) -> Any:
        nonlocal held
        if not held:
            held = True
            os.write(ready_fd, READY)
            os.close(ready_fd)
            with os.fdopen(go_fd, "rb") as go:
                if go.readline() != GO:
                    raise SystemExit("bench gate: no go from the parent (it ended); the passes were not run")
        return generate(self, *args, **kwargs)

    LLM.generate = gated  # type: ignore[method-assign]


def main() -> None:
    # Popped, so that the engine core and workers the bench spawns do not see it.
    if gate := os.environ.pop(GATE_ENV, None):
        ready_fd, go_fd = (int(fd) for fd in gate.split(","))
        hold_first_generate(ready_fd, go_fd)
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *sys.argv[1:]]
    vllm_main()


if __name__ == "__main__":
    main()
