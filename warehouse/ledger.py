"""The run ledger: which runs and attempts there are, what each has completed (its stages, each marked in the
transaction that writes its rows) and so what a new attempt resumes, and how each ended; what a completed run
evaluated (its inputs, which the nightly compares) and which hub releases were triggered (the release watcher)."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

from quantgate.catalog.errors import one_line
from quantgate.warehouse.reads import rows
from quantgate.warehouse.sessions import session
from quantgate.warehouse.statements import as_json, insert, insert_new, now, replace, transaction


def start_run(con, run_id: str, flow_name: str, model_id: str | None, catalog_path: str | None,
              catalog_hash: str | None, host: str, versions: dict[str, str]) -> None:
    with transaction(con):
        started = insert_new(con, "runs", {"run_id": run_id}, {
            "flow_name": flow_name, "model_id": model_id, "started_at": now(), "status": "running",
            "catalog_path": catalog_path, "catalog_hash": catalog_hash, "host": host, "versions": as_json(versions)})
        if not started:
            con.execute("UPDATE runs SET status = 'running', error = NULL, finished_at = NULL WHERE run_id = ?", [run_id])


def finish_run(con, run_id: str, error: str | None = None, attempt_id: str | None = None,
               cancelled: bool = False) -> None:
    """The run, and its attempt, over: completed, failed with `error`, or `cancelled` (from Prefect; `error` says
    how). A later run of the same request resumes a failed or cancelled run (`begin_run`)."""
    status = "cancelled" if cancelled else "failed" if error else "completed"
    with transaction(con):
        con.execute("UPDATE runs SET status = ?, error = ?, finished_at = ? WHERE run_id = ?",
                    [status, error, now(), run_id])
        if attempt_id:
            con.execute("UPDATE run_attempts SET status = ?, error = ?, finished_at = ? WHERE attempt_id = ?",
                        [status, error, now(), attempt_id])


def _pid_alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def _attempt_may_be_running(host: str | None, pid: int | None, this_host: str) -> bool:
    """Whether a 'running' attempt may still be at work: on this host, when its process is alive; on
    another host we cannot tell, so it may."""
    if host != this_host:
        return True
    return pid != os.getpid() and _pid_alive(pid)


def begin_run(con, attempt_id: str, flow_name: str, model_id: str, resume_key: str, catalog_path: str | None,
              catalog_hash: str | None, host: str, versions: dict[str, str],
              exclusive: bool = False) -> tuple[str, bool]:
    """Start a run for this flow run, or resume an unfinished one: (run_id, resumed).

    The latest run of `model_id` is resumed when it did not finish (failed, or running with no attempt
    that may still be at work), and was asked to do the same thing (`resume_key`). Its attempts that
    died without a word are marked abandoned. A Prefect retry of the same flow run continues its run.
    `exclusive`: the caller holds the model's lock (tasks/runtime/placement.py), so no other attempt of the
    model is at work on any host, whatever its row says; otherwise an attempt on another host may be.
    Otherwise a new run keyed by `attempt_id` starts; unfinished runs of the model whose processes are
    gone are then marked failed ("abandoned"), so that nothing stays 'running' forever.
    """
    with transaction(con):
        mine = con.execute("SELECT run_id FROM run_attempts WHERE attempt_id = ?", [attempt_id]).fetchone()
        if mine or con.execute("SELECT 1 FROM runs WHERE run_id = ?", [attempt_id]).fetchone():
            run_id = mine[0] if mine else attempt_id
            _attempt(con, attempt_id, run_id, host)
            con.execute("UPDATE runs SET status = 'running', error = NULL, finished_at = NULL WHERE run_id = ?", [run_id])
            return run_id, False
        unfinished = rows(con, "SELECT run_id, status, resume_key FROM runs WHERE flow_name = ? AND model_id = ?"
                               " AND status <> 'completed' ORDER BY started_at DESC", [flow_name, model_id])
        latest = con.execute("SELECT run_id FROM runs WHERE flow_name = ? AND model_id = ? ORDER BY started_at DESC"
                             " LIMIT 1", [flow_name, model_id]).fetchone()
        dead = []
        for run in unfinished:
            live = [] if exclusive else [
                a for a in rows(con, "SELECT host, pid FROM run_attempts WHERE run_id = ? AND status = 'running'",
                                [run["run_id"]]) if _attempt_may_be_running(a["host"], a["pid"], host)]
            legacy = not exclusive and run["status"] == "running" and not con.execute(
                "SELECT 1 FROM run_attempts WHERE run_id = ?", [run["run_id"]]).fetchone()
            if not live and not legacy:
                dead.append(run)
        for run in dead:
            con.execute("UPDATE run_attempts SET status = 'abandoned', finished_at = ?,"
                        " error = 'its process ended without finishing' WHERE run_id = ? AND status = 'running'",
                        [now(), run["run_id"]])
        resumable = next((r for r in dead if latest and r["run_id"] == latest[0] and r["resume_key"] == resume_key), None)
        if resumable:
            run_id = resumable["run_id"]
            con.execute("UPDATE runs SET status = 'running', error = NULL, finished_at = NULL WHERE run_id = ?", [run_id])
            _attempt(con, attempt_id, run_id, host)
            return run_id, True
        for run in dead:
            if run["status"] == "running":
                con.execute("UPDATE runs SET status = 'failed', finished_at = ?, error = ? WHERE run_id = ?",
                            [now(), f"abandoned: its process ended without finishing; not resumed by {attempt_id}",
                             run["run_id"]])
        start_run(con, attempt_id, flow_name, model_id, catalog_path, catalog_hash, host, versions)
        con.execute("UPDATE runs SET resume_key = ? WHERE run_id = ?", [resume_key, attempt_id])
        _attempt(con, attempt_id, attempt_id, host)
        return attempt_id, False


def _attempt(con, attempt_id: str, run_id: str, host: str) -> None:
    if not insert_new(con, "run_attempts", {"attempt_id": attempt_id}, {
            "run_id": run_id, "host": host, "pid": os.getpid(), "started_at": now(), "status": "running"}):
        con.execute("UPDATE run_attempts SET pid = ?, status = 'running', error = NULL, finished_at = NULL"
                    " WHERE attempt_id = ?", [os.getpid(), attempt_id])


def mark_stage(con, run_id: str, stage: str, item: str, detail: str | None, attempt_id: str,
               started_at: datetime | None = None, engine_starts: int = 0, marked_before: bool = True) -> None:
    """Mark a stage of a run complete, with when it began and the engine starts it made; call it inside the
    transaction that writes the stage's rows. `marked_before=False`: the caller knows the run has no mark for
    this item yet (it read the run's marks when it began and is the run's one attempt), sparing the lookup."""
    key = {"run_id": run_id, "stage": stage, "item": item}
    values = {"detail": detail, "attempt_id": attempt_id, "completed_at": now(), "started_at": started_at,
              "engine_starts": engine_starts}
    if marked_before:
        replace(con, "run_stages", key, values)
    else:
        insert(con, "run_stages", {**key, **values})


def completed_stages(con, run_id: str) -> dict[tuple[str, str], str | None]:
    """{(stage, item): detail} of the stages of a run marked complete."""
    found = con.execute("SELECT stage, item, detail FROM run_stages WHERE run_id = ?", [run_id]).fetchall()
    return {(stage, item): detail for stage, item, detail in found}


@contextmanager
def run_outcome(path: str | Path, run_id: str) -> Iterator[None]:
    """Marks the run completed when the block ends, or failed with the one-line error when it raises; an
    interrupt (SIGINT from a time limit, Ctrl-C) too, so that the run is not left 'running'."""
    try:
        yield
    except BaseException as e:
        error = one_line(e) if isinstance(e, Exception) else f"interrupted ({type(e).__name__})"
        with session(path) as con:
            finish_run(con, run_id, error=error)
        raise
    with session(path) as con:
        finish_run(con, run_id)


def record_inputs(con, run_id: str, model_id: str, inputs_hash: str, inputs: dict[str, Any]) -> None:
    """What a run evaluated, hashed: the nightly compares it with the model's inputs now."""
    with transaction(con):
        replace(con, "run_inputs", {"run_id": run_id}, {"model_id": model_id, "inputs_hash": inputs_hash,
                                                        "inputs": as_json(inputs), "recorded_at": now()})


def last_success_inputs(con, model_id: str) -> dict[str, Any] | None:
    """inputs_hash, inputs, run_id and finished_at of the model's latest completed run that recorded its inputs."""
    found = rows(
        con,
        "SELECT i.inputs_hash, i.inputs, i.run_id, r.finished_at FROM run_inputs i JOIN runs r USING (run_id)"
        " WHERE i.model_id = ? AND r.status = 'completed' ORDER BY r.finished_at DESC LIMIT 1",
        [model_id],
    )
    return found[0] if found else None


def seen_releases(con, releases: Sequence[tuple[str, str]]) -> set[tuple[str, str]]:
    """The (model id, commit sha) pairs the warehouse knows: evaluated (models) or already triggered."""
    if not releases:
        return set()
    values = ", ".join("(?, ?)" for _ in releases)
    params = [x for pair in releases for x in pair]
    found = con.execute(
        f"WITH wanted(model_id, sha) AS (VALUES {values})"
        " SELECT w.model_id, w.sha FROM wanted w WHERE EXISTS (SELECT 1 FROM models m WHERE m.model_id = w.model_id"
        " AND m.sha = w.sha) OR EXISTS (SELECT 1 FROM release_triggers t WHERE t.model_id = w.model_id AND t.sha = w.sha)",
        params,
    ).fetchall()
    return {(m, s) for m, s in found}


def record_trigger(con, model_id: str, sha: str, source: str, flow_run_id: str | None) -> bool:
    """Remember that a release was triggered; False when it already was (nothing is written then)."""
    with transaction(con):
        return insert_new(con, "release_triggers", {"model_id": model_id, "sha": sha},
                          {"source": source, "flow_run_id": flow_run_id, "triggered_at": now()})
