"""Do two or more runs of one model reach the same verdicts, on the same items? Read from their table folders.

    python benchmarks/compare_runs.py DIR DIR [DIR ...]            # markdown to stdout
    python benchmarks/compare_runs.py DIR DIR --out FILE           # ... and to FILE

Each DIR is a tables-only export of one evaluate-model run (what benchmarks/gpu/run_reference.sh writes), loaded as
benchmarks/summarize.py loads it. Printed: each variant's decision per run; each check's outcome, value and interval
per run; item by item, how many of each checkpoint's scored items (lm-eval's per-item score, and its detail: the
generated text or the log-likelihoods) differ from those of the run before it; the paired speedups with their range and
host-bound label; the cross-check's agreement. Exits 1 when a variant's decision differs between runs.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import duckdb

from quantgate.warehouse import reads
from summarize import load

DECISIONS = """
SELECT v.name AS variant, d.decision FROM decisions d JOIN variants v USING (variant_uid) ORDER BY variant"""
CHECKS = """
SELECT v.name AS variant, c.kind, coalesce(c.task || '/' || c.metric, c.name) AS "check", c.outcome, c.value, c.lower,
       c.upper
FROM decision_checks c JOIN variants v USING (variant_uid) ORDER BY variant, c.position"""
ITEMS = """
SELECT v.name AS variant, s.task, s.doc_id, s.metric, s.filter, s.value, s.detail::VARCHAR AS detail
FROM quality_samples s JOIN variants v USING (variant_uid)"""
ITEM_DIFFERENCES = """
SELECT variant, count(*) AS items, count(*) FILTER (WHERE a.value IS DISTINCT FROM b.value) AS scores_differ,
       count(*) FILTER (WHERE a.detail IS DISTINCT FROM b.detail) AS details_differ
FROM a JOIN b USING (variant, task, doc_id, metric, filter) GROUP BY ALL ORDER BY ALL"""
SPEEDUPS = """
SELECT v.name AS variant, s.engine, s.scenario, s.speedup, s.speedup_low, s.speedup_high, s.host_bound
FROM variant_speedup s JOIN variants v USING (variant_uid) WHERE s.status = 'ok' ORDER BY variant, engine, scenario"""
CROSSCHECK = "SELECT v.name AS variant, c.scenario, c.agreement FROM vllm_crosscheck c JOIN variants v USING (variant_uid)"


def _num(value: float | None, digits: int = 4) -> str:
    return "—" if value is None else f"{value:.{digits}g}"


def _interval(row: dict | None) -> str:
    if row is None:
        return "—"
    if row["lower"] is None:
        return f"{row['outcome']} {_num(row['value'])}"
    return f"{row['outcome']} {_num(row['value'])} [{_num(row['lower'])}, {_num(row['upper'])}]"


def _table(header: Sequence[str], rows: list[Sequence[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]


def compare(folders: Sequence[Path]) -> tuple[str, bool]:
    """The comparison as markdown, and whether every variant got the same decision in every run."""
    cons = [load(f) for f in folders]
    names = [f.name for f in folders]
    lines = [f"# Runs compared: {', '.join(names)}", ""]

    decisions = [{r["variant"]: r["decision"] for r in reads.rows(c, DECISIONS)} for c in cons]
    agreed = {v: len({d.get(v) for d in decisions}) == 1 for v in sorted(set().union(*decisions))}
    lines += ["## Decisions", ""] + _table(
        ["variant", *names, "same"],
        [[v, *(d.get(v, "—") for d in decisions), "yes" if same else "**no**"] for v, same in agreed.items()]) + [""]

    checks = [{(r["variant"], r["kind"], r["check"]): r for r in reads.rows(c, CHECKS)} for c in cons]
    keys = list(dict.fromkeys(k for run in checks for k in run))
    lines += ["## Checks: outcome, value [interval]", ""] + _table(
        ["variant", "kind", "check", *names, "same outcome"],
        [[*k, *(_interval(run.get(k)) for run in checks),
          "yes" if len({run[k]["outcome"] if k in run else None for run in checks}) == 1 else "**no**"]
         for k in keys]) + [""]

    items = [c.sql(ITEMS).df() for c in cons]
    item_rows = []
    for i in range(1, len(cons)):
        pair = duckdb.connect()
        pair.register("a", items[i - 1])
        pair.register("b", items[i])
        for r in reads.rows(pair, ITEM_DIFFERENCES):
            item_rows.append([f"{names[i - 1]} vs {names[i]}", r["variant"], str(r["items"]), str(r["scores_differ"]),
                              str(r["details_differ"])])
    lines += ["## Items: each checkpoint's scored items against the run before", ""] + _table(
        ["runs", "variant", "items", "scores differ", "details differ"], item_rows) + [""]

    speed = [{(r["variant"], r["engine"], r["scenario"]): r for r in reads.rows(c, SPEEDUPS)} for c in cons]
    keys = list(dict.fromkeys(k for run in speed for k in run))

    def shown(r: dict | None) -> str:
        if r is None or r["speedup"] is None:
            return "—"
        span = f" ({_num(r['speedup_low'], 3)}-{_num(r['speedup_high'], 3)})" if r["speedup_low"] is not None else ""
        return f"{_num(r['speedup'], 3)}x{span}{', host-bound' if r['host_bound'] else ''}"

    lines += ["## Speedups over the base (median of paired passes, their range)", ""] + _table(
        ["variant", "engine", "scenario", *names], [[*k, *(shown(run.get(k)) for run in speed)] for k in keys]) + [""]
    cross = [reads.rows(c, CROSSCHECK) for c in cons]
    lines += ["## Cross-check against `vllm bench throughput`", ""] + _table(
        ["run", "variant", "scenario", "agreement"],
        [[n, r["variant"], r["scenario"], r["agreement"] or "—"] for n, rows in zip(names, cross, strict=True)
         for r in rows]) + [""]
    return "\n".join(lines), all(agreed.values())


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, help="also write the markdown here")
    args = parser.parse_args(argv)
    if len(args.folders) < 2:
        parser.error("give two or more run folders")
    text, same = compare(args.folders)
    print(text)
    if args.out:
        args.out.write_text(text)
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
