"""The steps in flight when stages overlap (a build beside an evaluation beside a measurement): each step ends by
its own stage mark, the terminal's "done" line gives that step's own time, and an interrupt names every stage in
flight."""

from __future__ import annotations

import io
import signal
import time
from pathlib import Path

import pytest
from rich.console import Console

from quantgate.flows import progress
from quantgate.flows.interrupts import Interrupted, guard
from quantgate.flows.live import RunView


@pytest.fixture
def view() -> tuple[RunView, io.StringIO]:
    out = io.StringIO()
    console = Console(file=out, width=200)
    return RunView(Path("run.log"), console, console, quiet=False), out


def test_overlapping_steps_end_by_their_own_marks(view) -> None:
    run_view, out = view
    with progress.listening(run_view.on_step):
        progress.begin("quantize", "awq", "awq", 1, 2)
        time.sleep(0.3)
        progress.begin("evaluate", "base-uid", "base", 1, 3)
        progress.begin("benchmark", "base-uid", "base", 1, 3)
        assert progress.stages() == ["quantize", "evaluate", "benchmark"]
        assert progress.current().stage == "benchmark"

        progress.end("evaluate", "base-uid")
        progress.end("benchmark", "base-uid", completed=False)  # failed: no "done" line
        progress.end("quantize", "never-begun")  # reused as stored: no step
        assert progress.stages() == ["quantize"] and progress.current().checkpoint == "awq"
        progress.end("quantize", "awq")
        assert progress.current() is None
    lines = out.getvalue().splitlines()
    assert [line.rsplit(" in ", 1)[0] for line in lines] == ["done evaluate base (1/3)", "done quantize awq (1/2)"]
    evaluate_s, quantize_s = (float(line.rsplit(" in ", 1)[1].rstrip("s")) for line in lines)
    assert evaluate_s < 0.2 <= quantize_s  # each its own time, not the time since the step begun before it


def test_an_interrupt_names_every_stage_in_flight() -> None:
    with progress.listening(lambda done, latest: None):
        progress.begin("evaluate", "gptq-uid", "gptq")
        progress.begin("benchmark", "base-uid", "base")
        progress.begin("benchmark", "fp8-uid", "fp8")
        with pytest.raises(Interrupted, match=r"^interrupted \(SIGINT\) during evaluate, benchmark$"), guard():
            signal.raise_signal(signal.SIGINT)
        progress.finish()
        with pytest.raises(Interrupted, match=r"during startup$"), guard():
            signal.raise_signal(signal.SIGTERM)
