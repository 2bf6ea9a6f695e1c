"""One self-contained HTML page from the warehouse: regressions, scorecard, quality-vs-speed, memory,
energy and latency. Plots are hand-written inline SVG so the page needs no network and no plotting library."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from html import escape
from pathlib import Path
from typing import Any

from quantgate.catalog.records import RANDOM_WEIGHTS
from quantgate.warehouse import reads

ACCEPT, REJECT, INCONCLUSIVE, BASE, GRID = "#2e7d32", "#c62828", "#f9a825", "#607d8b", "#e0e0e0"
NOT_COMPARABLE = "#6a1b9a"
VERDICT_COLOURS = {"accept": ACCEPT, "reject": REJECT, "inconclusive": INCONCLUSIVE, "not_comparable": NOT_COMPARABLE}
PALETTE = ("#1565c0", "#ef6c00", "#6a1b9a", "#00838f", "#ad1457", "#558b2f", "#4e342e", "#283593")

# The latest successful measurement of each (model, variant, engine, scenario[, load]) across runs of any
# flow: a GPU-suite call that only re-ran serving must not hide the offline figures of the call before it.
_LATEST_SPEED = """
SELECT * EXCLUDE (rn) FROM (
    SELECT r.model_id, v.name AS variant, s.*,
           row_number() OVER (PARTITION BY r.model_id, s.variant_uid, s.engine, s.scenario ORDER BY r.started_at DESC) AS rn
    FROM stg_speed_results s JOIN runs r USING (run_id) JOIN variants v USING (variant_uid)
    WHERE s.status = 'ok' {where}
) WHERE rn = 1 ORDER BY model_id, variant, engine, scenario
"""
_LATEST_LATENCY = """
SELECT * EXCLUDE (rn) FROM (
    SELECT r.model_id, v.name AS variant, p.*,
           row_number() OVER (PARTITION BY r.model_id, p.variant_uid, p.engine, p.scenario, p.load
                              ORDER BY r.started_at DESC) AS rn
    FROM latency_percentiles p JOIN runs r USING (run_id) JOIN variants v USING (variant_uid)
    WHERE p.completed > 0 {where}
) WHERE rn = 1 ORDER BY model_id, variant, engine, scenario, max_concurrency NULLS LAST, request_rate, load
"""

# Cost of the latest measurement of each (model, variant, engine, scenario), priced with its run's own table.
_LATEST_COST = """
SELECT * EXCLUDE (rn) FROM (
    SELECT r.model_id, v.name AS variant, c.*,
           row_number() OVER (PARTITION BY r.model_id, c.variant_uid, c.engine, c.scenario ORDER BY r.started_at DESC) AS rn
    FROM variant_cost c JOIN runs r USING (run_id) JOIN variants v USING (variant_uid)
    WHERE c.usd_per_hour IS NOT NULL {where}
) WHERE rn = 1 ORDER BY model_id, variant, engine, scenario
"""
_LATEST_TUNED = """
SELECT * EXCLUDE (rn) FROM (
    SELECT r.model_id, t.*,
           row_number() OVER (PARTITION BY r.model_id, t.variant_uid, t.sweep ORDER BY r.started_at DESC) AS rn
    FROM tuned_serving_config t JOIN runs r USING (run_id) WHERE true {where}
) WHERE rn = 1 ORDER BY model_id, variant, sweep
"""

CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:24px 32px;color:#212121;max-width:1400px}
h1{font-size:22px;margin:0 0 4px}h2{font-size:18px;margin:28px 0 8px;border-bottom:1px solid #ccc;padding-bottom:4px}
h3{font-size:15px;margin:16px 0 6px}.meta,.note{color:#616161}.note{font-style:italic}
table{border-collapse:collapse;margin:6px 0 12px;font-size:13px}
th,td{border:1px solid #d0d0d0;padding:3px 8px;text-align:left;vertical-align:top}
th{background:#f5f5f5}td.num{text-align:right;font-variant-numeric:tabular-nums}
tr.accept td.decision{background:#c8e6c9;color:#1b5e20;font-weight:600}
tr.reject td.decision{background:#ffcdd2;color:#b71c1c;font-weight:600}
tr.inconclusive td.decision{background:#fff59d;color:#6d4c00;font-weight:600}
tr.not_comparable td.decision{background:#e1bee7;color:#4a148c;font-weight:600}
tr.flagged td{background:#fff3e0}td.build{white-space:nowrap}
table.scorecard{width:100%}table.scorecard td.deciding{max-width:28em}
td.details details{max-width:36em}td.details summary{cursor:pointer;color:#1565c0}td.details li.fail{color:#b71c1c}
td.details li.not_comparable,td.details li.anomalous{color:#4a148c}
td,th{overflow-wrap:anywhere}
.charts{display:flex;flex-wrap:wrap;gap:16px}svg{background:#fff;border:1px solid #e0e0e0}
svg text{font:11px system-ui,sans-serif;fill:#333}svg text.label{paint-order:stroke;stroke:#fff;stroke-width:3px}
"""


def render(con, model: str | None = None, title: str = "quantgate report") -> str:
    """The whole report as one HTML document, from a (read-only) warehouse connection."""
    params = [model] if model else []
    only = "AND model_id = ?" if model else ""
    moved = reads.rows(con, "SELECT * FROM regressions WHERE change IN ('worse', 'better', 'changed')"
                            f" {only} ORDER BY flagged DESC, model_id, variant, kind, measure", params)
    card = reads.rows(con, f"SELECT * FROM variant_scorecard {'WHERE model_id = ?' if model else ''}", params)
    speed = reads.rows(con, _LATEST_SPEED.format(where="AND r.model_id = ?" if model else ""), params)
    latency = reads.rows(con, _LATEST_LATENCY.format(where="AND r.model_id = ?" if model else ""), params)
    cost = reads.rows(con, _LATEST_COST.format(where="AND r.model_id = ?" if model else ""), params)
    tuned = reads.rows(con, _LATEST_TUNED.format(where="AND r.model_id = ?" if model else ""), params)
    generated = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    body = [f"<h1>{escape(title)}</h1>",
            f"<p class='meta'>generated {generated}{' · model ' + escape(model) if model else ''}</p>",
            _regressions(moved), _scorecard(card, _checks(con, card)), _tradeoffs(card), _cost(cost), _tuned(tuned),
            _memory_energy(speed), _latency(latency)]
    return ("<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
            f"<title>{escape(title)}</title><style>{CSS}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n")


def _checks(con, card: list[dict]) -> dict[tuple[str, str], list[dict]]:
    """Each scorecard row's decision checks, by (run, variant)."""
    runs = sorted({r["run_id"] for r in card})
    if not runs:
        return {}
    found = reads.rows(con, "SELECT run_id, variant_uid, checks FROM decisions WHERE list_contains(?, run_id)", [runs])
    out = {(f["run_id"], f["variant_uid"]): json.loads(f["checks"]) if isinstance(f["checks"], str) else f["checks"] or []
           for f in found}
    # Decisions since decision_checks keep their checks as rows (their JSON is NULL): in the older shape here.
    for c in reads.rows(con, "SELECT * FROM decision_checks WHERE list_contains(?, run_id) ORDER BY position", [runs]):
        passed = {"pass": True, "fail": False}.get(c["outcome"])
        out.setdefault((c["run_id"], c["variant_uid"]), []).append(
            {"check": c["name"], "passed": passed, "note": c["note"], "value": c["value"], "lower": c["lower"],
             "threshold": c["threshold"], "outcome": c["outcome"]})
    return out


def write(con, out: str | Path, model: str | None = None) -> Path:
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render(con, model), encoding="utf-8")
    return path


# --- sections ----------------------------------------------------------------------------------


def _regressions(moved: list[dict]) -> str:
    if not moved:
        return "<h2>Regressions</h2><p class='note'>Nothing moved beyond noise since the previous run.</p>"
    cols = ["kind", "model_id", "variant", "measure", "previous_value", "value", "delta", "noise", "change", "basis"]
    rows = [(("flagged" if r["flagged"] else ""), [r.get(c) for c in cols]) for r in moved]
    return ("<h2>Regressions</h2><p>Changes beyond noise since the previous run, worse first.</p>"
            + _table(cols, rows))


def _scorecard(card: list[dict], checks: dict[tuple[str, str], list[dict]]) -> str:
    """One row per variant, verdict first: the decision, the check that decided it (its number against its
    threshold) and the headline numbers; the full reason, every check and the rest on demand."""
    if not card:
        return "<h2>Scorecard</h2><p class='note'>No evaluate-model runs in this warehouse: no decisions yet.</p>"
    cols = ["decision", "deciding check", "model_id", "variant", "build", "size_ratio", "quality_recovery",
            "quality_lower_bound", "speedup", "details"]
    head = "".join(f"<th>{escape(c.replace('_', ' '))}</th>" for c in cols)
    body = []
    for r in card:
        found = checks.get((r["run_id"], r["variant_uid"]), [])
        cells = [f"<td class='decision'>{escape(r['decision'])}</td>",
                 f"<td class='deciding'>{escape(_deciding(r, found))}</td>",
                 f"<td class='model_id'>{escape(_fmt(r['model_id']))}{' (shape run, random weights)' if r.get('random_weights') else ''}</td>",
                 f"<td class='variant'>{escape(_fmt(r['variant']))}</td>",
                 f"<td class='build'>{escape(_build(r))}</td>",
                 *(f"<td class='num'>{escape(_fmt(r.get(c)))}</td>"
                   for c in ("size_ratio", "quality_recovery", "quality_lower_bound", "speedup")),
                 f"<td class='details'>{_details(r, found)}</td>"]
        body.append(f"<tr class='{escape(r['decision'])}'>{''.join(cells)}</tr>")
    shapes = sorted({r["model_id"] for r in card if r.get("random_weights")})
    shape_note = "".join(f"<p class='note shape-run'>{escape(m)}: a shape run with random weights: {escape(RANDOM_WEIGHTS)};"
                         " its speed, memory and time are the model's.</p>" for m in shapes)
    quantized = sorted({(r["model_id"], r["base_provenance"]) for r in card if r.get("base_prequantized")})
    shape_note += "".join(f"<p class='note provenance'>{escape(m)}: recoveries are against a {escape(label)} base (its"
                          " weights passed through quantization before the run), not the 16-bit release.</p>"
                          for m, label in quantized)
    return ("<h2>Scorecard</h2><p>Latest run of each model; the verdict and the check that decided it first, "
            "the full reason under <em>why</em>.</p>" + shape_note +
            f"<table class='scorecard'><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>")


def _deciding(r: dict, checks: list[dict]) -> str:
    """The deciding check of a scorecard row: the stored one (decision_checks: its number against its threshold,
    and for an inconclusive one the items that would decide it), else worked out from an older decision's JSON
    checks, else the reason's first clause."""
    if r.get("deciding_check"):
        value, threshold = r.get("deciding_value"), r.get("deciding_threshold")
        text = str(r["deciding_check"])
        if _finite(value) and _finite(threshold):
            text += f": {value:.4g} vs {threshold:.4g}"
        if r.get("items_to_decide"):
            text += f"; ~{int(r['items_to_decide']):,} items would decide"
        if r.get("deciding_outcome") in ("not_comparable", "anomalous"):
            text += f" ({r['deciding_outcome'].replace('_', ' ')})"
        return text
    return deciding_check(r["decision"], checks) or _first_clause(r["reason"])


def deciding_check(decision: str, checks: list[dict]) -> str | None:
    """The check that decided: a reject's first failed check; an accept's gated check closest to its
    threshold. Its name and number against its threshold, or None where the checks do not say."""
    gated = [c for c in checks if c.get("passed") is not None]
    if decision == "reject":
        pick = next((c for c in gated if c["passed"] is False), None)
    else:
        scored = [c for c in gated if _finite(_number(c)) and _finite(c.get("threshold"))]
        pick = min(scored, key=lambda c: abs(_number(c) - c["threshold"]), default=None)
    if pick is None:
        return None
    number, threshold = _number(pick), pick.get("threshold")
    if not (_finite(number) and _finite(threshold)):
        return str(pick.get("note") or pick.get("check"))
    if pick["passed"]:  # a gate passes above (recovery, speedup) or below (size) its threshold
        op = "≥" if number >= threshold else "≤"
    else:
        op = "<" if number < threshold else ">"
    measure = "CI low" if pick.get("lower") is not None else "value"
    return f"{pick['check']}: {measure} {number:.4g} {op} {threshold:.4g}"


def _number(check: dict) -> Any:
    return check["lower"] if check.get("lower") is not None else check.get("value")


def _outcome(check: dict) -> str:
    return check.get("outcome") or {True: "pass", False: "fail"}.get(check.get("passed"), "not_measured")


def _first_clause(reason: str | None) -> str:
    return (reason or "").split(";")[0]


def _details(r: dict, checks: list[dict]) -> str:
    more = ["flip_rate", "kl", "long_context", "speedup_basis", "serving_goodput_ratio", "serving_config",
            "usd_per_million_tokens", "cost_basis", "build_status"]
    facts = "".join(f"<li>{escape(c.replace('_', ' '))}: {escape(_fmt(r.get(c)))}</li>" for c in more
                    if r.get(c) is not None)
    listed = "".join(f"<li class='{_outcome(c)}'>{escape(str(c.get('note') or c.get('check')))}</li>" for c in checks)
    return (f"<details><summary>why</summary><p>{escape(r['reason'] or '')}</p>"
            + (f"<ul>{listed}</ul>" if listed else "") + (f"<ul>{facts}</ul>" if facts else "") + "</details>")


def _build(r: dict) -> str:
    parts = [r["method"], r["scheme"], f"{r['bits']}-bit" if r["bits"] else None,
             f"g{r['group_size']}" if r["group_size"] else None]
    return " ".join(str(p) for p in parts if p)


def _tradeoffs(card: list[dict]) -> str:
    if not card:
        return ""
    charts = []
    for model in sorted({r["model_id"] for r in card}):
        mine = [r for r in card if r["model_id"] == model and r["quality_recovery"] is not None]
        by_speed = bool(mine) and all(r["speedup"] is not None for r in mine)
        key = "speedup" if by_speed else "size_ratio"
        points = [r for r in mine if r[key] is not None]
        if not points:
            charts.append(f"<p class='note'>{escape(model)}: no variant has both quality and "
                          "speed or size figures.</p>")
            continue
        charts.append(_pareto_svg(model, points, key, higher_x_better=by_speed))
    return ("<h2>Quality against speed</h2><p>Quality recovery (bar: down to its confidence lower bound) against "
            "speedup, or size ratio where speed was not measured; dashed: the Pareto frontier; grey: the base.</p>"
            f"<div class='charts'>{''.join(charts)}</div>")


def _cost(cost: list[dict]) -> str:
    head = "<h2>Cost per million output tokens</h2>"
    if not cost:
        return head + ("<p class='note'>No priced measurements: give gpu_prices in the catalog (US$ per device-hour "
                       "by device kind) and rerun.</p>")
    cols = ["model_id", "variant", "engine", "scenario", "device", "num_devices", "usd_per_hour", "tokens_per_s",
            "usd_per_million_output_tokens", "slo_load", "usd_per_million_output_tokens_at_slo"]
    rows = [("", [r.get(c) for c in cols]) for r in cost]
    return (head + "<p>US$ per million output tokens = price per device-hour × devices ÷ (output tokens/s × 3600) × 1e6,"
            " with the prices stored with each run. At peak: the scenario's best throughput. At the SLO (serving): the"
            " fastest load where at least the SLO's attainment share (default 90%) of requests met every limit.</p>" + _table(cols, rows))


def tuned_verdict(r: dict) -> str:
    """One sentence: by how much the tuned config beat vLLM's defaults, by how little the best other lost, or
    that its gain was under the margin."""
    if r.get("default_goodput") is None:
        return "vLLM's defaults were not measured: no comparison"
    if r["best_point"] != "default":
        return f"{r['best_point']} beat vLLM's defaults by {r['gain_pct']:.0f}% goodput at the SLO"
    if r.get("best_other_point") is None:
        return "only vLLM's defaults were measured"
    if r.get("best_other_gain_pct") is None:
        return f"vLLM's defaults won; the best other point ({r['best_other_point']}) had no goodput"
    if r["best_other_gain_pct"] > 0:
        return (f"vLLM's defaults kept; {r['best_other_point']} gained only {r['best_other_gain_pct']:.1f}%, under the "
                f"{r['min_gain_pct']:g}% margin")
    return (f"vLLM's defaults won; the best other point ({r['best_other_point']}) lost by "
            f"{-r['best_other_gain_pct']:.0f}%")


def _tuned(tuned: list[dict]) -> str:
    if not tuned:
        return ""
    cols = ["model_id", "variant", "sweep", "best_point", "best_kernel", "best_goodput", "best_load", "default_goodput",
            "gain_pct", "points_ok", "verdict"]
    rows = [("", [tuned_verdict(r) if c == "verdict" else r.get(c) for c in cols]) for r in tuned]
    return ("<h2>Tuned serving config</h2><p>Best point of each variant's sweep of vLLM settings by goodput at the SLO"
            " (good requests/s at its best load), against vLLM's defaults.</p>" + _table(cols, rows))


def _memory_energy(speed: list[dict]) -> str:
    head = "<h2>Memory and energy</h2>"
    if not speed:
        return head + "<p class='note'>No successful speed measurements.</p>"
    peak: dict[tuple, int] = {}
    for r in speed:
        if r["peak_memory_bytes"] is not None:
            k = (r["model_id"], r["variant"], r["engine"])
            peak[k] = max(peak.get(k, 0), r["peak_memory_bytes"])
    engines = sorted({k[2] for k in peak})
    mem = [(f"{m} · {v} · {e}", b / 2**30, PALETTE[engines.index(e) % len(PALETTE)]) for (m, v, e), b in peak.items()]
    energy_rows = [r for r in speed if _finite(r["energy_j_per_token"])]
    engines_e = sorted({r["engine"] for r in energy_rows})
    energy = [(f"{r['model_id']} · {r['variant']} · {r['engine']}/{r['scenario']}", r["energy_j_per_token"],
               PALETTE[engines_e.index(r["engine"]) % len(PALETTE)]) for r in energy_rows]
    parts = [head, "<div class='charts'>"]
    parts.append(_hbars_svg("Peak memory per variant and engine (GiB, highest over scenarios)", mem, "{:.2f}")
                 if mem else "<p class='note'>No peak memory recorded.</p>")
    parts.append(_hbars_svg("Energy per output token (J)", energy, "{:.3g}")
                 if energy else "<p class='note'>No energy recorded (needs NVML on a GPU).</p>")
    return "".join(parts) + "</div>"


def _latency(latency: list[dict]) -> str:
    head = "<h2>Serving latency</h2>"
    if not latency:
        return head + "<p class='note'>No serving loads measured: latency percentiles need the GPU suite's serving part.</p>"
    series = [(f"{r['model_id']} · {r['variant']} · {r['engine']} · {r['load']}", r) for r in latency]
    charts = []
    for measure, name in (("ttft", "Time to first token"), ("tpot", "Time per output token"),
                          ("itl", "Inter-token latency"), ("e2el", "End-to-end latency")):
        lines = [(label, [(q, r.get(f"{measure}_p{q}_ms")) for q in (50, 90, 99)]) for label, r in series]
        lines = [(label, [(q, v) for q, v in pts if _finite(v)]) for label, pts in lines]
        lines = [ln for ln in lines if ln[1]]
        if lines:
            charts.append(_lines_svg(f"{name} (ms) by percentile", lines))
    return (head + "<p>Percentiles over the successful requests of each load (c = concurrency, rate = requests/s)."
            f"</p><div class='charts'>{''.join(charts)}</div>")


# --- tables and SVG ----------------------------------------------------------------------------


def _table(cols: Sequence[str], rows: Sequence[tuple[str, Sequence[Any]]]) -> str:
    head = "".join(f"<th>{escape(c.replace('_', ' '))}</th>" for c in cols)  # spaces let narrow headers wrap
    body = []
    for cls, values in rows:
        cells = []
        for c, v in zip(cols, values):
            kind = "num" if isinstance(v, (int, float)) and not isinstance(v, bool) else c
            cells.append(f"<td class='{kind}'>{escape(_fmt(v))}</td>")
        body.append(f"<tr class='{escape(cls)}'>{''.join(cells)}</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def _fmt(v: Any) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{v:.4g}"
    return str(v)


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    step = 10 ** math.floor(math.log10((hi - lo) / n))
    step *= next(m for m in (1, 2, 2.5, 5, 10) if (hi - lo) / (step * m) <= n)
    first = math.ceil(lo / step - 1e-9) * step
    return [round(first + i * step, 10) for i in range(int((hi - first) / step + 1e-9) + 1)]


def _span(values: Sequence[float], pad: float = 0.08) -> tuple[float, float]:
    lo, hi = min(values), max(values)
    width = (hi - lo) or abs(hi) * 0.1 or 1.0
    return lo - width * pad, hi + width * pad


def _line(x1: float, y1: float, x2: float, y2: float, stroke: str, width: float = 1) -> str:
    return f"<line x1='{x1:.1f}' y1='{y1:.1f}' x2='{x2:.1f}' y2='{y2:.1f}' stroke='{stroke}' stroke-width='{width:g}'/>"


def _text(x: float, y: float, s: str, anchor: str = "start", cls: str = "") -> str:
    klass = f" class='{cls}'" if cls else ""
    return f"<text{klass} x='{x:.1f}' y='{y:.1f}' text-anchor='{anchor}'>{escape(s)}</text>"


class _Plot:
    """A rectangle of SVG with linear x and y scales, axes, ticks and gridlines."""

    def __init__(self, w: int, h: int, xr: tuple[float, float], yr: tuple[float, float], margin=(56, 16, 28, 44)):
        self.w, self.h, self.xr, self.yr = w, h, xr, yr
        self.left, self.right, self.top, self.bottom = margin
        self.parts: list[str] = []

    def x(self, v: float) -> float:
        return self.left + (v - self.xr[0]) / (self.xr[1] - self.xr[0]) * (self.w - self.left - self.right)

    def y(self, v: float) -> float:
        return self.h - self.bottom - (v - self.yr[0]) / (self.yr[1] - self.yr[0]) * (self.h - self.top - self.bottom)

    def axes(self, title: str, xlabel: str, ylabel: str, xticks: Sequence[tuple[float, str]] | None = None,
             yticks: bool = True) -> None:
        xt = xticks if xticks is not None else [(t, f"{t:g}") for t in _ticks(*self.xr)]
        for t in _ticks(*self.yr) if yticks else []:
            self.parts.append(_line(self.left, self.y(t), self.w - self.right, self.y(t), GRID)
                              + _text(self.left - 4, self.y(t) + 4, f"{t:g}", "end"))
        for t, label in xt:
            self.parts.append(_line(self.x(t), self.top, self.x(t), self.h - self.bottom, GRID)
                              + _text(self.x(t), self.h - self.bottom + 14, label, "middle"))
        self.parts.append(f"<rect x='{self.left}' y='{self.top}' width='{self.w - self.left - self.right}' "
                          f"height='{self.h - self.top - self.bottom}' fill='none' stroke='#9e9e9e'/>"
                          f"<text x='{self.w / 2:.0f}' y='16' text-anchor='middle' font-weight='bold'>{escape(title)}</text>")
        if xlabel:
            self.parts.append(f"<text x='{(self.left + self.w - self.right) / 2:.0f}' y='{self.h - 6}' "
                              f"text-anchor='middle'>{escape(xlabel)}</text>")
        if ylabel:
            self.parts.append(f"<text transform='translate(14 {(self.top + self.h - self.bottom) / 2:.0f}) rotate(-90)' "
                              f"text-anchor='middle'>{escape(ylabel)}</text>")

    def svg(self, label: str) -> str:
        return (f"<svg xmlns='http://www.w3.org/2000/svg' role='img' aria-label='{escape(label)}' width='{self.w}' "
                f"height='{self.h}' viewBox='0 0 {self.w} {self.h}'>{''.join(self.parts)}</svg>")


def pareto(points: Sequence[tuple[float, float]], higher_x_better: bool = True) -> list[int]:
    """Indices of the points no other point beats on both x and y (y higher is better), in x order."""
    order = sorted(range(len(points)), key=lambda i: (points[i][0] if higher_x_better else -points[i][0], points[i][1]),
                   reverse=True)
    best, front = -math.inf, []
    for i in order:
        if points[i][1] > best:
            front.append(i)
            best = points[i][1]
    return sorted(front, key=lambda i: points[i][0])


def _pareto_svg(model: str, rows: list[dict], key: str, higher_x_better: bool) -> str:
    xs = [r[key] for r in rows] + [1.0]
    lows = [r["quality_lower_bound"] for r in rows if _finite(r["quality_lower_bound"])]
    ys = [r["quality_recovery"] for r in rows] + lows + [1.0]
    p = _Plot(560, 380, _span(xs), _span(ys, 0.12))
    xlabel = "speedup over base (×)" if key == "speedup" else "size ratio to base (lower is smaller)"
    p.axes(model, xlabel, "quality recovery")
    front = pareto([(r[key], r["quality_recovery"]) for r in rows], higher_x_better)
    if len(front) > 1:
        pts = " ".join(f"{p.x(rows[i][key]):.1f},{p.y(rows[i]['quality_recovery']):.1f}" for i in front)
        p.parts.append(f"<polyline points='{pts}' fill='none' stroke='#424242' stroke-dasharray='5 4'/>")
    bx, by = p.x(1.0), p.y(1.0)
    near_edge = bx > p.w - 150
    p.parts.append(f"<path d='M{bx:.1f} {by - 6:.1f}l6 6l-6 6l-6-6z' fill='{BASE}'/>"
                   + _text(bx - 8 if near_edge else bx + 8, by - 6, "base", "end" if near_edge else "start"))
    for i, r in enumerate(rows):
        colour = VERDICT_COLOURS.get(r["decision"], REJECT)
        cx, cy = p.x(r[key]), p.y(r["quality_recovery"])
        if _finite(r["quality_lower_bound"]):
            ly = p.y(r["quality_lower_bound"])
            p.parts.append(_line(cx, cy, cx, ly, colour, 1.5) + _line(cx - 4, ly, cx + 4, ly, colour, 1.5))
        ring = " stroke='#212121' stroke-width='2'" if i in front else ""
        right = cx > p.w - 150  # labels near the right edge go to the left of their point
        p.parts.append(f"<circle cx='{cx:.1f}' cy='{cy:.1f}' r='5' fill='{colour}'{ring}>"
                       f"<title>{escape(r['variant'])}: {escape(r['reason'] or '')}</title></circle>"
                       + _text(cx - 8 if right else cx + 8, cy + 4, f"{r['variant']} ({r['decision']})",
                               "end" if right else "start", "label"))
    return p.svg(f"quality against {key} for {model}")


def _hbars_svg(title: str, items: list[tuple[str, float, str]], fmt: str) -> str:
    bar, label_w, w = 18, 330, 660
    h = 40 + len(items) * (bar + 6) + 24
    top = max(v for _, v, _ in items) * 1.15 or 1.0
    p = _Plot(w, h, (0, top), (0, 1), margin=(label_w, 16, 28, 28))
    p.axes(title, "", "", [(t, f"{t:g}") for t in _ticks(0, top)], yticks=False)
    for i, (label, v, colour) in enumerate(items):
        y = 30 + i * (bar + 6)
        p.parts.append(f"<text x='{label_w - 6}' y='{y + 13}' text-anchor='end'>{escape(label)}</text>"
                       f"<rect x='{p.x(0):.1f}' y='{y}' width='{p.x(v) - p.x(0):.1f}' height='{bar}' fill='{colour}'/>"
                       f"<text x='{p.x(v) + 4:.1f}' y='{y + 13}'>{fmt.format(v)}</text>")
    return p.svg(title)


def _lines_svg(title: str, lines: list[tuple[str, list[tuple[float, float]]]]) -> str:
    qs = sorted({q for _, pts in lines for q, _ in pts})
    pos: Callable[[float], float] = lambda q: float(qs.index(q))  # noqa: E731 - evenly spaced percentiles
    values = [v for _, pts in lines for _, v in pts]
    legend_h = 16 * len(lines)
    p = _Plot(560, 300 + legend_h, (-0.3, len(qs) - 0.7), _span([0.0, *values]), margin=(56, 16, 28, 44 + legend_h))
    p.axes(title, "", "ms", [(pos(q), f"p{q:g}") for q in qs])
    for i, (label, pts) in enumerate(lines):
        colour = PALETTE[i % len(PALETTE)]
        path = " ".join(f"{p.x(pos(q)):.1f},{p.y(v):.1f}" for q, v in pts)
        p.parts.append(f"<polyline points='{path}' fill='none' stroke='{colour}' stroke-width='2'/>"
                       + "".join(f"<circle cx='{p.x(pos(q)):.1f}' cy='{p.y(v):.1f}' r='3' fill='{colour}'>"
                                 f"<title>{escape(label)} p{q:g}: {v:.4g} ms</title></circle>" for q, v in pts))
        ly = 300 - 10 + i * 16
        p.parts.append(f"<line x1='60' x2='84' y1='{ly}' y2='{ly}' stroke='{colour}' stroke-width='2'/>"
                       f"<text x='90' y='{ly + 4}'>{escape(label)}</text>")
    return p.svg(title)
