"""docs/results.md: the "Verdicts on the H200" section, generated from a committed reference run's tables.

    python benchmarks/readme_verdicts.py benchmarks/results/h200/reference12          # print the section
    python benchmarks/readme_verdicts.py benchmarks/results/h200/reference12 --write  # replace it in docs/results.md

The folder holds the tables a run measured (Parquet, as `quantgate export --tables-only` writes them); they are
loaded through today's migrations and views (benchmarks/summarize.py), and the section lists, per variant, its
verdict, each gated quality check with its interval and power, the flip rate, the KL divergence, the speedup
on the gated engine and the cost per million output tokens; then the base's score on each gated check beside
the figure its makers published, with the tolerance a verdict checks it against, protocol and source, from the
model's `published` list in the catalog (--catalog, default catalog/models.yaml, loaded through its schema). Nothing
in it is typed by hand.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.summarize import load  # noqa: E402
from quantgate.catalog.errors import CatalogError
from quantgate.catalog.load import load_catalog
from quantgate.catalog.models import ModelSpec, PublishedFigure
from quantgate.catalog.paths import DEFAULT_CATALOG
from quantgate.warehouse import reads  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "results.md"
BEGIN, END = "<!-- verdicts:begin -->", "<!-- verdicts:end -->"


def _num(value: Any, digits: int = 3) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def _shown(path: Path) -> str:
    path = path.resolve()
    return path.relative_to(REPO).as_posix() if path.is_relative_to(REPO) else path.as_posix()


def _spec(catalog: Path, model_id: str) -> ModelSpec | None:
    try:
        return load_catalog(catalog).model(model_id)
    except CatalogError as e:
        if f"unknown model {model_id!r}" not in str(e):
            raise
        return None


def _published(catalog: Path, model_id: str) -> tuple[dict[tuple[str, str], PublishedFigure], str | None]:
    """The model's published figures by (task, metric), or none and why."""
    spec = _spec(catalog, model_id)
    if spec is None:
        return {}, f"{_shown(catalog)} has no model {model_id}, so no published figure stands beside its scores."
    figures = {(f.task, f.metric): f for f in spec.published}
    why = None if figures else (f"{_shown(catalog)} declares no published figure for {model_id}"
                                " (its `published` list; the comment there says why).")
    return figures, why


def _tolerance(figure: PublishedFigure | None) -> str:
    """The protocol difference the entry allows, which a verdict checks the base's interval against
    (tasks/steps/baseline.py); a figure without one is shown and never checked."""
    if figure is None:
        return "—"
    return "— (not checked)" if figure.tolerance is None else f"± {figure.tolerance:.3f}"


def _base_beside_published(con: Any, run_id: str, model_id: str, catalog: Path) -> list[str]:
    figures, why = _published(catalog, model_id)
    base = reads.rows(con, "SELECT c.name, c.task, c.metric, json_extract_string(c.detail, '$.filter') AS filter,"
                           " min(c.position) AS position, any_value(q.value) AS value,"
                           " any_value(q.n_samples) AS items, any_value(q.protocol) AS protocol"
                           " FROM decision_checks c LEFT JOIN stg_run_quality q ON q.run_id = c.run_id"
                           " AND q.role = 'base' AND q.task = c.task AND q.metric = c.metric"
                           " AND q.filter = json_extract_string(c.detail, '$.filter')"
                           " WHERE c.run_id = ? AND c.kind = 'quality' GROUP BY ALL ORDER BY position", [run_id])
    rows = [(r["name"] + (f" ({r['filter']})" if r["filter"] not in (None, "none") else ""), r["value"], r["items"],
             r["protocol"], figures.pop((r["task"], r["metric"]), None)) for r in base]
    # A figure for a check this run did not gate (its policy then differed from today's catalog) is still shown.
    rows += [(f"{f.task}/{f.metric}", None, None, None, f) for f in figures.values()]
    lines = ["", f"The base beside the figures its makers published ({_shown(catalog)}, the model's `published`):", "",
             "| gated check | base | items | our protocol | published | tolerance | ours − published | their protocol"
             " | source |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, value, items, protocol, f in rows:
        gap = None if f is None or value is None else value - f.value
        lines.append(f"| {name} | {_num(value)} | {items or '—'} | {protocol or '—'} | {_num(f and f.value)} |"
                     f" {_tolerance(f)} | {'—' if gap is None else f'{gap:+.3f}'} | {f.protocol if f else '—'} |"
                     f" {f.source if f else '—'} |")
    if why:
        lines += ["", why]
    return lines


def _builds_beside_published(con: Any, run_id: str, model_id: str, catalog: Path) -> list[str]:
    """Each published recovery of a near model's quantized build beside ours of the variant of the same method and
    bits on the same gated check (none where this run has no such variant)."""
    spec = _spec(catalog, model_id)
    if spec is None or not spec.published_recoveries:
        return []
    ours = reads.rows(con, "SELECT v.name AS variant, v.method, v.bits, c.task, c.metric, c.value, c.lower, c.upper"
                           " FROM decision_checks c JOIN variants v USING (variant_uid)"
                           " WHERE c.run_id = ? AND c.kind = 'quality' ORDER BY v.name", [run_id])
    lines = ["", f"Quantized builds of the nearest model their publisher measured, beside ours of the same method and bits"
                 f" ({_shown(catalog)}, the model's `published_recoveries`): another model, so the direction is what"
                 " compares, not the figure.", "",
             "| their build | their model | check | their recovery | our variant | our recovery | 95% interval |"
             " their protocol | source |", "|---|---|---|---|---|---|---|---|---|"]
    for p in spec.published_recoveries:
        mine = [r for r in ours if (r["method"], r["bits"], r["task"], r["metric"]) == (p.method, p.bits, p.task,
                                                                                          p.metric)]
        for r in mine or [None]:
            interval = "—" if r is None or r["lower"] is None else f"[{_num(r['lower'])}, {_num(r['upper'])}]"
            lines.append(f"| {p.build} | {p.model} | {p.task}/{p.metric} | {_num(p.recovery)} |"
                         f" {r['variant'] if r else '— (no such variant)'} | {_num(r and r['value'])} | {interval} |"
                         f" {p.protocol} | {p.source} |")
    return lines


def section(folder: Path, catalog: Path = DEFAULT_CATALOG) -> str:
    con = load(folder)
    (run,) = reads.rows(con, "SELECT r.run_id, r.model_id, r.started_at, t.wall_seconds, t.engine_starts"
                             " FROM runs r JOIN run_timeline t USING (run_id) WHERE r.flow_name = 'evaluate-model'"
                             " ORDER BY r.started_at DESC LIMIT 1")
    card = reads.rows(con, "SELECT * FROM variant_scorecard WHERE run_id = ? ORDER BY variant", [run["run_id"]])
    (evals,) = reads.rows(con, "SELECT count(*) AS n, count(*) FILTER (WHERE engine_starts = 0) AS reused"
                               " FROM stage_times WHERE run_id = ? AND stage = 'evaluate'", [run["run_id"]])
    scenarios = sorted({r["scenario"] for r in reads.rows(
        con, "SELECT DISTINCT split_part(scenario, '@', 1) AS scenario FROM speed_results WHERE run_id = ?",
        [run["run_id"]])})
    checks = reads.rows(con, "SELECT v.name AS variant, c.* FROM decision_checks c JOIN variants v USING (variant_uid)"
                             " WHERE c.run_id = ? AND c.kind IN ('quality', 'speed', 'serving')"
                             " ORDER BY v.name, c.position", [run["run_id"]])
    device = reads.rows(con, "SELECT any_value(device) AS device FROM speed_results WHERE run_id = ?"
                             " AND status = 'ok' AND device IS NOT NULL", [run["run_id"]])[0]["device"]
    lines = [BEGIN,
             f"{run['model_id']} on one {device or 'GPU'}, run `{run['run_id'][:8]}` ({run['started_at']:%Y-%m-%d}):"
             f" {run['wall_seconds']:.0f} s from start to decisions, {run['engine_starts']} engine starts,"
             f" {evals['reused']} of its {evals['n']} evaluations reused from an earlier run; speed measured on"
             f" {', '.join(scenarios) or 'nothing'}."
             f" Generated by `python benchmarks/readme_verdicts.py {folder.as_posix()}"
             f"{'' if catalog == DEFAULT_CATALOG else f' --catalog {_shown(catalog)}'} --write` from the tables the"
             " run wrote and the catalog.", "",
             "| variant | verdict | size | speedup | US$ / M tokens | flip rate | KL | deciding check |",
             "|---|---|---|---|---|---|---|---|"]
    for r in card:
        deciding = "—" if not r["deciding_check"] else (
            f"{r['deciding_check']} {_num(r['deciding_value'])} vs {_num(r['deciding_threshold'], 2)}")
        lines.append(f"| {r['variant']} | **{r['decision']}** | {_num(r['size_ratio'], 2)}× | {_num(r['speedup'], 2)}× |"
                     f" {_num(r['usd_per_million_tokens'])} | {_num(r['flip_rate'])} | {_num(r['kl'], 4)} | {deciding} |")
    lines += ["", "Each gated check: quality as recovery with its 95% interval, speed as the speedup with its passes' range,"
                  " serving as the goodput ratio.", "",
              "| variant | gated check | recovery or ratio | interval or range | smallest drop it can see | items |"
              " outcome |", "|---|---|---|---|---|---|---|"]
    for c in checks:
        interval = "—" if c["lower"] is None else f"[{_num(c['lower'])}, {_num(c['upper'])}]"
        lines.append(f"| {c['variant']} | {c['name']} | {_num(c['value'])} | {interval} |"
                     f" {_num(c['min_detectable_drop'])} | {c['items'] or '—'} | {c['outcome']} |")
    lines += ["", "The reasons, as the run stored them (`decisions.reason`):", ""]
    lines += [f"- **{r['variant']}**: {r['reason']}" for r in card]
    lines += _base_beside_published(con, run["run_id"], run["model_id"], catalog)
    lines += _builds_beside_published(con, run["run_id"], run["model_id"], catalog)
    lines.append(END)
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--catalog", type=Path, default=DEFAULT_CATALOG,
                        help="the catalog whose model's published figures stand beside the base (default: %(default)s)")
    parser.add_argument("--write", action="store_true", help="replace the section in docs/results.md")
    args = parser.parse_args()
    try:
        text = section(args.folder, args.catalog)
    except CatalogError as e:
        sys.exit(f"error: {e}")
    if not args.write:
        print(text)
        return
    readme = PAGE.read_text()
    if BEGIN not in readme or END not in readme:
        sys.exit(f"error: {PAGE}: no {BEGIN} … {END} markers to write between")
    head, rest = readme.split(BEGIN, 1)
    PAGE.write_text(head + text + rest.split(END, 1)[1])


if __name__ == "__main__":
    main()
