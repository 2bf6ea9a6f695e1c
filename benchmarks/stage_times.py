"""Where the time of evaluate-model runs went, side by side: seconds per stage, engine starts, wall time.

    python benchmarks/stage_times.py WAREHOUSE [RUN_ID ...]      # default: the two latest runs (before, after)
    python benchmarks/stage_times.py WAREHOUSE --model smollm2-135m

Reads the warehouse's `stage_times` and `run_timeline` views (read-only); a run of a warehouse written before
stage start times were kept shows its stages without seconds.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from quantgate.warehouse import reads, sessions  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("warehouse")
    parser.add_argument("runs", nargs="*", help="run ids (default: the two latest)")
    parser.add_argument("--model", help="only runs of this model")
    args = parser.parse_args()
    with sessions.session(args.warehouse, read_only=True) as con:
        runs = args.runs or [r["run_id"] for r in reversed(reads.rows(
            con, "SELECT run_id FROM runs WHERE flow_name = 'evaluate-model' AND (? IS NULL OR model_id = ?)"
                 " ORDER BY started_at DESC LIMIT 2", [args.model, args.model]))]
        if not runs:
            sys.exit(f"error: no evaluate-model runs in {args.warehouse}")
        stages = {run: {r["stage"]: r for r in reads.stage_summary(con, run)} for run in runs}
        timeline = {r["run_id"]: r for r in reads.rows(
            con, f"SELECT * FROM run_timeline WHERE run_id IN ({', '.join('?' * len(runs))})", runs)}
    order = list(dict.fromkeys(stage for run in runs for stage in stages[run]))
    table = Table(title="seconds per stage (first start to last end; items of a stage may overlap)")
    table.add_column("stage")
    for run in runs:
        table.add_column(f"{run[:8]} s", justify="right")
        table.add_column("starts", justify="right")
    if len(runs) == 2:
        table.add_column("after / before", justify="right")

    def cell(value: object) -> str:
        return "—" if value is None else f"{value:.1f}" if isinstance(value, float) else str(value)

    for stage in order:
        row = [stage]
        for run in runs:
            found = stages[run].get(stage, {})
            row += [cell(found.get("seconds")), cell(found.get("engine_starts"))]
        if len(runs) == 2:
            a, b = (stages[run].get(stage, {}).get("seconds") for run in runs)
            row.append(f"{b / a:.2f}" if a and b is not None else "—")
        table.add_row(*row)
    total = ["wall (start to end)"]
    for run in runs:
        t = timeline.get(run, {})
        total += [cell(t.get("wall_seconds")), cell(t.get("engine_starts"))]
    if len(runs) == 2:
        a, b = (timeline.get(run, {}).get("wall_seconds") for run in runs)
        total.append(f"{b / a:.2f}" if a and b is not None else "—")
    table.add_row(*total, style="bold")
    Console(width=160).print(table)


if __name__ == "__main__":
    main()
