"""`quantgate reproduce`: the `lm_eval run` command lines that reproduce a run's stored quality scores outside
quantgate, item for item, and (--compare) the samples those commands wrote set beside the stored ones.

Registered on the CLI's app by flows/cli.py; the commands come from each evaluation's stored config
(tasks/adapters/evaluators/lm_eval_cli.py), so a run stored before this command existed is reproducible too."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.console import Console
from rich.table import Table

from quantgate.flows.verdicts import cell
from quantgate.tasks.adapters.evaluators import lm_eval_cli
from quantgate.warehouse import evaluations, sessions

FORMATS = ("table", "csv", "json", "markdown")
COMPARED = ["variant", "task", "metric", "filter", "items", "reproduced", "equal", "differ", "max_abs_diff"]


def reproductions(con, run_id: str, variant: str | None, out: Path) -> list[dict[str, Any]]:
    """One row per `lm_eval run` command of the run's evaluations (base first): which checkpoint and evaluation,
    its tasks, environment, arguments, the shell line and what it cannot carry (notes)."""
    found = []
    for ev in _evaluations(con, run_id, variant):
        commands = lm_eval_cli.reproductions(ev["config"], str(out / ev["variant"]), load_time=ev["method"] == "bnb")
        if not commands:
            found.append({**_about(ev), "tasks": None, "command": None,
                          "notes": ["a load-time (bitsandbytes) variant: only quantgate's loader builds its model"]})
        found += [{**_about(ev), "tasks": ",".join(c.tasks), "env": c.env, "argv": c.argv, "command": c.command,
                   "notes": c.notes} for c in commands]
    return found


def comparisons(con, run_id: str, variant: str | None, out: Path) -> list[dict[str, Any]]:
    """Per checkpoint and (task, metric, filter): the stored items beside those the printed commands wrote under
    `out/<checkpoint>` (equal bit for bit, differing, the largest difference)."""
    found = []
    for ev in _evaluations(con, run_id, variant):
        reproduced = lm_eval_cli.read_samples(out / ev["variant"])
        stored = evaluations.evaluation_samples(con, ev["variant_uid"], ev["eval_key"])
        found += [{"variant": ev["variant"], **row} for row in lm_eval_cli.compare(stored, reproduced)]
    return found


def _evaluations(con, run: str, variant: str | None) -> list[dict[str, Any]]:
    run_id = evaluations.resolve_run(con, run)
    if run_id is None:
        raise typer.BadParameter(f"no run {run!r} and no finished run of a model {run!r} in the warehouse",
                                 param_hint="run")
    found = [ev for ev in evaluations.run_evaluations(con, run_id, variant) if ev["status"] == "ok"]
    if not found:
        raise typer.BadParameter(f"run {run_id} has no stored evaluation{f' of {variant!r}' if variant else ''}")
    return found


def _about(ev: dict[str, Any]) -> dict[str, Any]:
    return {"variant": ev["variant"], "role": ev["role"], "eval_key": ev["eval_key"],
            "measured_run_id": ev["measured_run_id"]}


def reproduce(
    run: Annotated[str, typer.Argument(help="a run id, or a model id for its latest run")],
    variant: Annotated[Optional[str], typer.Argument(help="only this checkpoint ('base' for the base)")] = None,
    out: Annotated[Path, typer.Option(help="where the commands write their samples: a folder per checkpoint")]
    = Path("reproduce"),
    compare: Annotated[bool, typer.Option(help="set the samples the commands wrote under --out beside the stored"
                                                " ones, item for item")] = False,
    warehouse: Annotated[Optional[str], typer.Option("--warehouse", "-w",
                                                     help="the warehouse (env QUANTGATE_WAREHOUSE)")] = None,
    fmt: Annotated[str, typer.Option("--format", "-f", help="table, csv, json or markdown")] = "table",
) -> None:
    """Print the lm_eval command lines that reproduce a run's stored quality scores item for item (base first);
    with --compare, how the samples they wrote under --out match the stored ones."""
    if fmt not in FORMATS:
        raise typer.BadParameter(f"unknown format {fmt!r}: use {', '.join(FORMATS)}", param_hint="--format")
    with sessions.session(warehouse, read_only=True) as con:
        found = comparisons(con, run, variant, out) if compare else reproductions(con, run, variant, out)
    if fmt != "table":
        import pandas as pd

        frame = pd.DataFrame(found)
        text = {"csv": lambda: frame.to_csv(index=False), "markdown": lambda: frame.to_markdown(index=False) + "\n",
                "json": lambda: frame.to_json(orient="records", indent=1) + "\n"}[fmt]()
        sys.stdout.write(text)
    elif compare:
        table = Table()
        for c in COMPARED:
            table.add_column(c, overflow="fold")
        for r in found:
            table.add_row(*[cell(r.get(c)) for c in COMPARED])
        Console(soft_wrap=True).print(table)
    else:
        # Shell lines, to paste: each checkpoint's commands after a comment naming it.
        for r in found:
            notes = "".join(f"\n# note: {n}" for n in r["notes"])
            head = f"# {r['variant']} ({r['role']}): evaluation {r['eval_key']}, measured in run {r['measured_run_id']}"
            sys.stdout.write(f"{head}{notes}\n{r['command'] or ''}\n")
