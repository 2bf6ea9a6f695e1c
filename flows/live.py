"""What a person sees of a run: one live line (stage, checkpoint, step k of N, elapsed, estimate) on a
terminal, one plain line per finished step otherwise, nothing with --quiet. Everything else the process
and its children write (Prefect's log, progress bars, library logs, engine output) goes to one log file
per run under the work dir, redirected at the descriptor level so that child processes write there too."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.live import Live
from rich.text import Text

from quantgate.catalog.settings import settings
from quantgate.flows import progress


def work_dir(explicit: str | None = None) -> Path:
    """Where checkpoints, caches and run logs are kept: `explicit`, else QUANTGATE_HOME, else ./.quantgate."""
    return Path(explicit or settings().home).resolve()


@dataclass
class RunView:
    """The terminal while a run's output goes to `log_path`: `out` for results, `err` for the error line."""

    log_path: Path
    out: Console
    err: Console
    quiet: bool
    began: float = field(default_factory=time.monotonic)
    durations: dict[str, list[float]] = field(default_factory=dict)  # seconds of each finished step, by stage
    live: Live | None = None

    def on_step(self, done: progress.Step | None, step: progress.Step | None) -> None:
        if done is not None:
            seconds = time.monotonic() - done.started
            self.durations.setdefault(done.stage, []).append(seconds)
            if self.live is None and not self.quiet:
                self.out.print(f"done {done.label()} in {seconds:.1f}s", highlight=False)
        if self.live is not None:
            self.live.update(self.render(step))

    def render(self, step: progress.Step | None = None) -> Text:
        step = step or progress.current()
        total = _clock(time.monotonic() - self.began)
        if step is None:
            return Text(f"starting  total {total}", style="dim")
        text = Text()
        text.append(step.stage, style="bold cyan")
        text.append(f"  {step.checkpoint}" if step.checkpoint else "")
        text.append(f"  step {step.index} of {step.total}  {_clock(time.monotonic() - step.started)}")
        if (eta := self.estimate(step)) is not None:
            text.append(f"  ~{_clock(eta)} left in {step.stage}", style="dim")
        text.append(f"  total {total}", style="dim")
        return text

    def estimate(self, step: progress.Step) -> float | None:
        """Seconds left in the stage: this stage's mean step so far times the steps not yet done."""
        took = self.durations.get(step.stage)
        if not took:
            return None
        mean = sum(took) / len(took)
        return max(mean - (time.monotonic() - step.started), 0.0) + mean * (step.total - step.index)


def _clock(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    return f"{m // 60}:{m % 60:02d}:{s:02d}" if m >= 60 else f"{m}:{s:02d}"


def log_file(workdir: Path, label: str) -> Path:
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", label).strip("-")[:60] or "run"
    return workdir / "logs" / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{slug}.log"


@contextmanager
def run_view(workdir: Path, label: str, quiet: bool = False) -> Iterator[RunView]:
    """Send this process's stdout and stderr (and its children's) to the run's log file while the block
    runs; show the run's progress on the terminal they were."""
    path = log_file(workdir, label)
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    terminal_out = os.fdopen(os.dup(saved[0]), "w", buffering=1)
    terminal_err = os.fdopen(os.dup(saved[1]), "w", buffering=1)
    interactive = terminal_out.isatty() and not quiet
    view = RunView(path, Console(file=terminal_out, soft_wrap=True), Console(file=terminal_err, soft_wrap=True), quiet)
    if not quiet:
        view.err.print(f"log: {path}", highlight=False)
    log_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    try:
        with progress.listening(view.on_step):
            if interactive:
                with Live(view.render(), console=view.out, refresh_per_second=2, transient=True,
                          get_renderable=view.render) as view.live:
                    yield view
            else:
                yield view
    finally:
        view.live = None
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)
        terminal_out.close()
        terminal_err.close()
        _log_the_rest_to(path)


def _log_the_rest_to(path: Path) -> None:
    """Log handlers that write to the terminal (Prefect's console handler) keep writing to the run's log, so
    that what Prefect logs at interpreter exit (its temporary server stopping) does not reach the terminal."""
    stream = path.open("a", buffering=1)
    loggers = [logging.getLogger(), *(logging.getLogger(n) for n in list(logging.root.manager.loggerDict))]
    for logger in loggers:
        for handler in getattr(logger, "handlers", []):
            if isinstance(handler, logging.StreamHandler) and getattr(handler.stream, "fileno", None):
                with contextlib.suppress(OSError, ValueError, AttributeError):  # lastResort-like handlers
                    if handler.stream.fileno() in (1, 2):
                        handler.setStream(stream)
                        if isinstance(console := getattr(handler, "console", None), Console):  # Prefect's prints through Rich
                            console.file = stream
