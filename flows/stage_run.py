"""The run a flow run works on, as its stages see it: which stages it has completed (the warehouse's stage marks), the
one way a stage runs (`StageRun.step`: reuse what is stored, else compute, and store with the mark) and the one
transaction a stage's rows and mark commit in (`StageRun.stage`: after a crash both are there or neither). Each stage
item it begins and ends is told to the live view (flows/progress.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeVar

from prefect import get_run_logger

from quantgate.catalog.stages import Stage
from quantgate.flows import interrupts, progress
from quantgate.tasks.runtime import faults
from quantgate.warehouse import lake, ledger, sessions, statements

T = TypeVar("T")


@dataclass
class StageCommit:
    """A stage's open transaction, and the detail its completion mark will carry."""

    con: Any
    detail: str | None


class StageRun:
    """The warehouse run a flow run works on, and which of its stages are already complete."""

    def __init__(self, wh: str, run_id: str, attempt_id: str) -> None:
        self.wh, self.run_id, self.attempt_id = wh, run_id, attempt_id
        with sessions.session(wh, read_only=True) as con:
            self.done = ledger.completed_stages(con, run_id)
        # How many items each stage has, and how many have begun: "step k of N" in the live view.
        self.totals: dict[Stage, int] = {}
        self._begun: dict[Stage, int] = {}

    def enter(self, stage: Stage, item: str = "", label: str = "") -> None:
        """The run begins an item of a stage (for the live view and for an interrupt's reason); its stage mark
        ends it."""
        self._begun[stage] = k = self._begun.get(stage, 0) + 1
        progress.begin(stage, item, label, k, max(k, self.totals.get(stage, 1)))

    def is_done(self, stage: Stage, item: str = "") -> bool:
        return (stage, item) in self.done

    def read(self, query: Callable[[Any], T]) -> T:
        with sessions.session(self.wh, read_only=True) as con:
            return query(con)

    @contextmanager
    def stage(self, stage: Stage, item: str = "", detail: str | None = None, started: datetime | None = None,
              engine_starts: int = 0) -> Iterator[StageCommit]:
        """One transaction for a stage's rows and its completion mark: after a crash both are there or neither.
        The body may set the mark's detail on what it yields, once its rows say what it is. Nothing is stored once
        the run is being interrupted (interrupts.refuse_results)."""
        interrupts.refuse_results()
        with sessions.session(self.wh) as con, statements.transaction(con):
            commit = StageCommit(con, detail)
            yield commit
            ledger.mark_stage(con, self.run_id, stage, item, commit.detail, self.attempt_id, started or statements.now(),
                             engine_starts, marked_before=(stage, item) in self.done)
            faults.point(f"write:{stage}")
        self.done[(stage, item)] = commit.detail
        progress.end(stage, item)

    def step(self, stage: Stage, item: str, *, stored: Callable[[Any], T | None], compute: Callable[[], T],
             write: Callable[[Any, T, bool], str | None], starts: Callable[[T], int] = lambda _: 0,
             label: str = "") -> T:
        """Reuse what is stored, else compute, and store with the stage mark: the one way a stage runs.

        `stored(con)` is the stage's result already in the warehouse (this run's, after a crash, or any run's
        of the same content), or None; `compute()` makes it; `write(con, value, reused)` stores or links it
        and returns the mark's detail. The mark carries the stage's start and its engine starts."""
        found = self.read(stored)
        if found is not None and self.is_done(stage, item):
            return found
        self.enter(stage, item, label)
        started = statements.now()
        try:
            value = found if found is not None else compute()
        except BaseException:
            progress.end(stage, item, completed=False)
            raise
        with self.stage(stage, item, None, started, 0 if found is not None else starts(value)) as commit:
            commit.detail = write(commit.con, value, found is not None)
        return value

    def finish(self, error: str | None, cancelled: bool = False) -> None:
        """The run's row ended: completed (`error` None), failed with its one line, or cancelled."""
        try:
            with sessions.session(self.wh) as con:
                ledger.finish_run(con, self.run_id, error=error, attempt_id=self.attempt_id, cancelled=cancelled)
        except lake.WarehouseError as e:
            if error is None:
                raise
            # The warehouse itself is the trouble; the run stays unfinished and the next run resumes it.
            get_run_logger().warning("could not record the failure of run %s: %s", self.run_id, e)
