"""Summaries of every run in a folder of warehouse table files, regenerated from those tables.

    python benchmarks/summarize.py DIR [--out DIR]
    python benchmarks/summarize.py DIR --sql "select * from vllm_crosscheck"   # any query over DIR's tables + views

DIR holds a tables-only Parquet export (`quantgate export DIR --tables-only`, or what benchmarks/gpu/run_suite.sh
and run_real.sh write). Its tables are loaded into a fresh in-memory warehouse through this checkout's migrations,
so the views are today's SQL over them; then summary.md and summary.json (the figures the markdown shows,
unformatted) are written to --out (default DIR), one part per run: evaluate-model runs (scorecard, decisions,
builds, quality, recovery, KL, flips, the serving gate, stage times, and the speed tables) and gpu-suite runs
(benchmarks/gpu/summary.py). Runs in start order, rows sorted, numbers rounded: the same tables give the same bytes.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import date
from decimal import Decimal
from pathlib import Path
from typing import Any

import duckdb
from quantgate.warehouse import lake, reads, sessions, transfer

# benchmarks/gpu/summary.py, found beside this script.
from gpu import summary as gpu_summary
from gpu.summary import Section, cell, count, fixed, gib, percent

MIB = 1024**2
# Tables of the GPU suite's own steps and levers: an evaluate-model run never has rows there.
SUITE_ONLY = {"steps", "offline", "levers"}
SIGNIFICANT_DIGITS = 6


@dataclass(frozen=True)
class RunSummary:
    run: dict[str, Any]
    markdown: str
    sections: list[Section]


def load(folder: Path) -> duckdb.DuckDBPyConnection:
    """A fresh in-memory warehouse holding the folder's tables, with this checkout's views over them."""
    con = duckdb.connect()
    # Ties in the views' aggregates (arg_min, first) are broken in scan order, which parallel scans may change.
    con.execute("SET threads = 1")
    sessions.migrate(con, folder)
    transfer.load_parquet(con, folder)
    return con


def summarize(con: duckdb.DuckDBPyConnection) -> list[RunSummary]:
    runs = reads.rows(con, "SELECT * FROM runs ORDER BY started_at, run_id")
    out = []
    for run in runs:
        if run["flow_name"] == "gpu-suite":
            out.append(RunSummary(run, gpu_summary.render(con, run["run_id"]), gpu_summary.sections(con, run["run_id"])))
        else:  # evaluate-model; another flow (bench-endpoint) has speed tables only
            parts = evaluate_sections(con, run["run_id"]) if run["flow_name"] == "evaluate-model" else []
            parts += [s for s in gpu_summary.sections(con, run["run_id"]) if s.key not in SUITE_ONLY]
            out.append(RunSummary(run, _run_markdown(run, parts), parts))
    return out


def evaluate_sections(con: duckdb.DuckDBPyConnection, rid: str) -> list[Section]:
    """What an evaluate-model run decided and measured, before its speed tables."""
    parts = [
        Section("scorecard", "Scorecard", reads.rows(
            con, "SELECT * FROM variant_scorecard WHERE run_id = ? ORDER BY variant", [rid]), [
            ("variant", "variant", str), ("method", "method", str), ("scheme", "scheme", cell), ("bits", "bits", str),
            ("size ratio", "size_ratio", fixed(3)), ("recovery", "quality_recovery", fixed(4)),
            ("lower bound", "quality_lower_bound", fixed(4)), ("flip rate", "flip_rate", percent), ("KL", "kl", fixed(4)),
            ("long context", "long_context_recovery", fixed(3)), ("speedup", "speedup", fixed(2)),
            ("basis", "speedup_basis", cell), ("US$ / M tokens", "usd_per_million_tokens", fixed(4)),
            ("serving goodput ratio", "serving_goodput_ratio", fixed(3)), ("build", "build_status", str),
            ("decision", "decision", str), ("reason", "reason", cell),
        ], note="The contract view: the latest completed or failed run of each model only."),
        Section("decisions", "Decisions", reads.rows(
            con, "SELECT d.*, v.name AS variant FROM decisions d JOIN variants v USING (variant_uid)"
                 " WHERE d.run_id = ? ORDER BY v.name", [rid]), [
            ("variant", "variant", str), ("decision", "decision", str), ("recovery", "quality_recovery", fixed(4)),
            ("lower bound", "quality_lower_bound", fixed(4)), ("flip rate", "flip_rate", percent),
            ("speedup", "speedup", fixed(2)), ("size ratio", "size_ratio", fixed(3)), ("reason", "reason", cell),
        ]),
        Section("builds", "Builds", reads.rows(
            con, "SELECT v.*, rv.role, rv.reused, CASE WHEN v.skipped THEN 'skipped' ELSE v.status END AS build_status"
                 " FROM run_variants rv JOIN variants v USING (variant_uid) WHERE rv.run_id = ? ORDER BY rv.role, v.name",
            [rid]), [
            ("variant", "name", str), ("role", "role", str), ("method", "method", str), ("scheme", "scheme", cell),
            ("group", "group_size", cell), ("MiB", "size_bytes", lambda v: fixed(1)(v / MIB)),
            ("build s", "build_seconds", fixed(1)), ("peak GiB", "peak_memory_bytes", gib), ("reused", "reused", str),
            ("status", "build_status", str), ("error", "error", cell),
        ]),
        Section("quality", "Quality (lm-eval)", reads.rows(
            con, "SELECT q.*, v.name AS variant FROM stg_run_quality q JOIN variants v USING (variant_uid)"
                 " WHERE q.run_id = ? ORDER BY q.task, q.metric, q.filter, q.role, v.name", [rid]), [
            ("variant", "variant", str), ("task", "task", str), ("metric", "metric", str), ("filter", "filter", str),
            ("value", "value", fixed(4)), ("stderr", "stderr", fixed(4)), ("n", "n_samples", count),
        ]),
        Section("recovery", "Recovery (variant ÷ base, inverted for lower-is-better)", reads.rows(
            con, "SELECT r.*, v.name AS variant FROM variant_recovery r JOIN variants v USING (variant_uid)"
                 " WHERE r.run_id = ? ORDER BY v.name, r.task, r.metric, r.filter", [rid]), [
            ("variant", "variant", str), ("task", "task", str), ("metric", "metric", str), ("filter", "filter", str),
            ("variant value", "variant_value", fixed(4)), ("base value", "base_value", fixed(4)),
            ("recovery", "recovery", fixed(4)),
        ]),
        Section("flips", "Flip rates (items whose correctness changed)", reads.rows(
            con, "SELECT f.*, v.name AS variant FROM variant_flips f JOIN variants v USING (variant_uid)"
                 " WHERE f.run_id = ? ORDER BY v.name, f.task, f.metric, f.filter", [rid]), [
            ("variant", "variant", str), ("task", "task", str), ("metric", "metric", str), ("items", "n_items", count),
            ("to wrong", "to_wrong_rate", percent), ("to right", "to_right_rate", percent),
            ("flip rate", "flip_rate", percent),
        ]),
        Section("kl", "KL divergence from the base (per token, on the perplexity text)", reads.rows(
            con, "SELECT k.*, v.name AS variant FROM variant_kl k JOIN variants v USING (variant_uid)"
                 " WHERE k.run_id = ? ORDER BY v.name", [rid]), [
            ("variant", "variant", str), ("KL", "kl", fixed(4)), ("stderr", "kl_stderr", fixed(4)),
            ("tokens", "kl_tokens", count),
        ]),
        Section("serving_gate", "Serving gate: tuned config's goodput at the SLO against the base's", reads.rows(
            con, "SELECT s.*, v.name AS variant FROM variant_serving s JOIN variants v USING (variant_uid)"
                 " WHERE s.run_id = ? ORDER BY v.name, s.engine, s.scenario", [rid]), [
            ("variant", "variant", str), ("engine", "engine", str), ("scenario", "scenario", str),
            ("point", "point", cell), ("load", "load", cell), ("goodput req/s", "goodput_requests_per_s", fixed(2)),
            ("base point", "base_point", cell), ("base goodput req/s", "base_goodput_requests_per_s", fixed(2)),
            ("ratio", "goodput_ratio", fixed(3)), ("status", "status", str), ("reason", "reason", cell),
        ]),
        Section("speedups", "Speedups over the base, with every pairing of passes", reads.rows(
            con, "SELECT s.*, v.name AS variant FROM variant_speedup s JOIN variants v USING (variant_uid)"
                 " WHERE s.run_id = ? AND s.speedup IS NOT NULL ORDER BY v.name, s.engine, s.scenario", [rid]), [
            ("variant", "variant", str), ("engine", "engine", str), ("scenario", "scenario", str),
            ("speedup", "speedup", fixed(2)), ("low", "speedup_low", fixed(2)), ("high", "speedup_high", fixed(2)),
            ("passes", "passes", cell), ("base passes", "base_passes", cell),
            ("host-bound", "host_bound", cell), ("busiest CPU share", "host_busy_share", percent),
        ], note="low pairs the variant's slowest pass with the base's fastest, high its fastest with the base's slowest;"
                " host-bound: the host paced either side's passes (its busiest process on a CPU 90% or more of a pass,"
                " decode steps 3x or more the weights' memory floor), so the ratio moves with the host."),
    ]
    if _has_relation(con, "stage_times"):  # since migration 0009; runs before it have no start times
        parts.append(Section("stage_times", "Stage times", reads.rows(
            con, "SELECT * FROM stage_times WHERE run_id = ? AND started_at IS NOT NULL"
                 " ORDER BY started_at, stage, checkpoint NULLS FIRST, item", [rid]), [
            ("stage", "stage", str), ("checkpoint", "checkpoint", cell), ("seconds", "seconds", fixed(1)),
            ("engine starts", "engine_starts", count), ("reused", "reused", cell),
        ]))
    return parts


def _has_relation(con: duckdb.DuckDBPyConnection, name: str) -> bool:
    return con.execute("SELECT count(*) FROM information_schema.tables WHERE table_name = ?", [name]).fetchone()[0] > 0


def _run_markdown(run: dict[str, Any], parts: Sequence[Section]) -> str:
    versions = json.loads(run["versions"] or "{}")
    lines = [
        f"# {run['flow_name']}: {run['model_id']}",
        "",
        f"Run `{run['run_id']}` on {run['host']}, {run['started_at']:%Y-%m-%d %H:%M} UTC, {run['status']}"
        + (f": {cell(run['error'])}" if run["error"] else "") + "."
        + f" Versions: {', '.join(f'{k} {v}' for k, v in sorted(versions.items()))}.",
        "",
    ]
    for section in parts:
        lines += section.markdown()
    return "\n".join(lines)


def markdown(summaries: Sequence[RunSummary]) -> str:
    parts = ["Generated by `python benchmarks/summarize.py DIR` from the table files of DIR, through this checkout's"
             " views; edit nothing here, regenerate.\n"]
    parts += [s.markdown.rstrip("\n") + "\n" for s in summaries] or ["No runs in these tables.\n"]
    return "\n".join(parts)


def figures(summaries: Sequence[RunSummary]) -> dict[str, Any]:
    runs = []
    for s in summaries:
        run = {k: s.run[k] for k in ("run_id", "flow_name", "model_id", "status", "error", "host", "started_at",
                                     "finished_at")}
        run["versions"] = json.loads(s.run["versions"] or "{}")
        run["figures"] = {section.key: section.figures() for section in s.sections}
        runs.append(run)
    return _plain({"runs": runs})


def _plain(value: Any) -> Any:
    """JSON-ready and stable: floats to a fixed number of significant digits, NaN as null, times as ISO text."""
    if isinstance(value, float):
        return None if not math.isfinite(value) else float(f"{value:.{SIGNIFICANT_DIGITS}g}")
    if isinstance(value, Decimal):
        return _plain(float(value))
    if isinstance(value, date):
        return value.isoformat()
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def write(folder: Path, out: Path) -> list[Path]:
    con = load(folder)
    try:
        summaries = summarize(con)
    finally:
        con.close()
    out.mkdir(parents=True, exist_ok=True)
    md, js = out / "summary.md", out / "summary.json"
    md.write_text(markdown(summaries))
    js.write_text(json.dumps(figures(summaries), indent=1, sort_keys=True, ensure_ascii=False) + "\n")
    return [md, js]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="a folder of table files (Parquet)")
    parser.add_argument("--out", type=Path, help="where summary.md and summary.json go (default: the folder)")
    parser.add_argument("--sql", help="print this query's result over the folder's tables and views instead")
    args = parser.parse_args(argv)
    try:
        if args.sql:
            _query(args.folder, args.sql)
            return
        files = write(args.folder, args.out or args.folder)
    except (lake.WarehouseError, duckdb.Error) as e:
        sys.exit(f"error: {str(e).splitlines()[0]}")
    print(" ".join(str(f) for f in files))


def _query(folder: Path, sql: str) -> None:
    con = load(folder)
    try:
        con.sql(sql).show(max_width=10_000, max_rows=10_000)
    finally:
        con.close()


if __name__ == "__main__":
    main()
