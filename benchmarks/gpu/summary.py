"""Markdown summary of a gpu-suite run, from the warehouse (default: its latest gpu-suite run).

    python benchmarks/gpu/summary.py gpu.ducklake [--run-id ID] [--parquet DIR] > summary.md

With --parquet, every table is also written to DIR as Parquet (views are derived: `benchmarks/summarize.py DIR`
recomputes them and summarizes every run).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from quantgate.warehouse import reads, sessions, transfer

GIB = 1024**3


def render(con: Any, run_id: str | None = None) -> str:
    run = _run(con, run_id)
    if run is None:
        return "# GPU suite\n\nNo gpu-suite run in this warehouse.\n"
    found = reads.rows(con, "SELECT s.device FROM speed_results s JOIN variants v USING (variant_uid)"
                            " WHERE s.run_id = ? AND s.device IS NOT NULL ORDER BY v.name, s.scenario, s.engine LIMIT 1",
                       [run["run_id"]])
    device = found[0]["device"] if found else "unknown device"
    versions = json.loads(run["versions"] or "{}")
    parts = [
        f"# GPU suite: {run['model_id']} on {device}",
        "",
        f"Run `{run['run_id']}` on {run['host']}, {run['started_at']:%Y-%m-%d %H:%M} UTC, {run['status']}."
        f" Versions: {', '.join(f'{k} {v}' for k, v in sorted(versions.items()))}.",
        "Weights are random (dummy) with the model's real shapes: speed only, never quality.",
        "",
    ]
    for section in sections(con, run["run_id"]):
        parts += section.markdown()
    return "\n".join(parts)


def sections(con: Any, rid: str) -> list[Section]:
    """The tables of a run's speed figures, in the order the summary shows them (any run: a gpu-suite run has
    them all, an evaluate-model run those of its benchmarks)."""
    speed = reads.rows(
        con,
        "SELECT s.*, v.name AS variant, v.weights FROM speed_results s JOIN variants v USING (variant_uid)"
        " WHERE s.run_id = ? ORDER BY v.name, s.scenario, s.engine",
        [rid],
    )
    latency = [
        r for r in speed if r["decode_tokens_per_s"] is not None or (r["status"] != "ok" and "latency" in r["scenario"])
    ]
    return [
        Section("steps", "Steps", reads.rows(
            con, "SELECT * FROM suite_steps WHERE run_id = ? ORDER BY step_index", [rid]), [
            ("#", "step_index", str), ("part", "part", str), ("engine", "engine", str), ("build", "build", str),
            ("scenarios", "scenarios", lambda v: ", ".join(v)), ("status", "status", str),
            ("seconds", "seconds", fixed(0)), ("reason", "reason", cell),
        ]),
        Section("offline", "Offline throughput (output tokens/s): Transformers vs vLLM", _offline(speed), [
            ("variant", "variant", str), ("Transformers", "transformers", fixed(0)), ("vLLM", "vllm", fixed(0)),
            ("vLLM ÷ Transformers", "ratio", fixed(2)), ("note", "note", cell),
        ], note="Same 'offline' scenario for both engines; vLLM takes every prompt in one call, Transformers"
                " runs static batches. `vllm bench throughput` is in the cross-check below."),
        Section(
            "speedup",
            "Quantized over base (same engine and scenario)",
            reads.rows(con, "SELECT s.*, v.name AS variant FROM variant_speedup s JOIN variants v USING (variant_uid)"
                            " WHERE s.run_id = ? AND s.speedup IS NOT NULL ORDER BY v.name, s.scenario, s.engine", [rid]),
            [("variant", "variant", str), ("engine", "engine", str), ("scenario", "scenario", str),
             ("tok/s", "tokens_per_s", fixed(0)), ("base tok/s", "base_tokens_per_s", fixed(0)), ("speedup", "speedup", fixed(2)),
             ("TPOT ms", "tpot_ms", fixed(2)), ("base TPOT ms", "base_tpot_ms", fixed(2))],
        ),
        Section(
            "crosscheck",
            "vLLM cross-check: ours vs `vllm bench throughput` on the same config",
            reads.rows(con, "SELECT c.*, v.name AS variant FROM vllm_crosscheck c JOIN variants v USING (variant_uid)"
                            " WHERE c.run_id = ? ORDER BY v.name, c.scenario", [rid]),
            [("variant", "variant", str), ("scenario", "scenario", str),
             ("ours out tok/s", "ours_output_tokens_per_s", fixed(0)), ("bench out tok/s", "bench_output_tokens_per_s", fixed(0)),
             ("gap %", "output_gap_pct", fixed(1)), ("agreement", "agreement", cell),
             ("ours passes", "ours_passes", str), ("ours slowest", "ours_slowest_pass", fixed(0)),
             ("ours fastest", "ours_fastest_pass", fixed(0)), ("bench passes", "bench_passes", str),
             ("bench slowest", "bench_slowest_pass", fixed(0)), ("bench fastest", "bench_fastest_pass", fixed(0)),
             ("ours total tok/s", "ours_total_tokens_per_s", fixed(0)),
             ("bench total tok/s", "bench_total_tokens_per_s", fixed(0)), ("gap %", "total_gap_pct", fixed(1)),
             ("note", "reason", cell)],
        ),
        Section("latency", "Batch-1 latency and the memory-bandwidth roofline", latency, [
            ("variant", "variant", str), ("engine", "engine", str), ("scenario", "scenario", str),
            ("TTFT ms", "ttft_ms", fixed(1)), ("TPOT ms", "tpot_ms", fixed(2)), ("decode tok/s", "decode_tokens_per_s", fixed(0)),
            ("weights GB/token", "weight_bytes_per_token", lambda v: fixed(2)(v / 1e9 if v else None)),
            ("bandwidth GB/s", "bandwidth_gbps", fixed(0)), ("% of roofline", "roofline_fraction", percent),
            ("status", "status", str), ("reason", "reason", cell),
        ]),
        Section(
            "serving",
            "Serving (vLLM): latency percentiles and goodput per load",
            reads.rows(
                con,
                "SELECT p.*, g.output_tokens_per_s, g.goodput_requests_per_s, g.good_fraction, g.energy_j_per_token,"
                " v.name AS variant FROM latency_percentiles p"
                " JOIN serving_goodput g USING (run_id, variant_uid, engine, scenario, load)"
                " JOIN variants v USING (variant_uid) WHERE p.run_id = ?"
                " ORDER BY v.name, p.scenario, p.request_rate NULLS FIRST, p.max_concurrency",
                [rid],
            ),
            [("variant", "variant", str), ("scenario", "scenario", str), ("load", "load", str),
             ("ok/sent", "completed", str), ("TTFT p50", "ttft_p50_ms", fixed(1)), ("TTFT p99", "ttft_p99_ms", fixed(1)),
             ("TPOT p50", "tpot_p50_ms", fixed(2)), ("TPOT p99", "tpot_p99_ms", fixed(2)),
             ("ITL p99", "itl_p99_ms", fixed(2)), ("E2EL p50", "e2el_p50_ms", fixed(0)),
             ("out tok/s", "output_tokens_per_s", fixed(0)), ("goodput req/s", "goodput_requests_per_s", fixed(2)),
             ("good %", "good_fraction", percent), ("J/token", "energy_j_per_token", fixed(3))],
            note="Milliseconds. Goodput: requests meeting the scenario's SLO per second of the load.",
        ),
        Section("memory", "Memory and energy", [r for r in speed if r["status"] == "ok"], [
            ("variant", "variant", str), ("engine", "engine", str), ("scenario", "scenario", str),
            ("peak GiB", "peak_memory_bytes", gib), ("NVML peak GiB", "nvml_peak_bytes", gib),
            ("torch peak GiB", "torch_peak_bytes", gib), ("KV cache tokens", "kv_cache_tokens", count),
            ("KV cache GiB", "kv_cache_bytes", gib), ("J/token", "energy_j_per_token", fixed(3)),
        ], note="Peak: device memory in use at its highest during the scenario (NVML, minus what was in use"
                " before), or the torch allocator's reserve if higher; vLLM reserves gpu_memory_utilization of"
                " the GPU up front. Torch peak is the measuring process's allocator (vLLM's is in its engine core)."),
        Section(
            "tuned_serving",
            "Tuned serving config (sweep of vLLM settings): best point by goodput at the SLO vs vLLM's defaults",
            reads.rows(con, "SELECT * FROM tuned_serving_config WHERE run_id = ? ORDER BY variant, sweep", [rid]),
            [("variant", "variant", str), ("sweep", "sweep", str), ("points", "points", str), ("ok", "points_ok", str),
             ("best point", "best_point", str), ("kernel", "best_kernel", cell),
             ("best goodput req/s", "best_goodput", fixed(2)), ("at load", "best_load", cell),
             ("default goodput req/s", "default_goodput", fixed(2)), ("gain %", "gain_pct", fixed(1)),
             ("best other point", "best_other_point", cell), ("its gain %", "best_other_gain_pct", fixed(1)),
             ("margin %", "min_gain_pct", fixed(1))],
            note="gain % > 0: the tuned config beat vLLM's defaults; when the defaults win, the best other point's"
                 " gain says by how little it lost, or that it gained less than the margin (run-to-run noise).",
        ),
        Section(
            "cost",
            "Cost per million output tokens",
            reads.rows(con, "SELECT c.*, v.name AS variant FROM variant_cost c JOIN variants v USING (variant_uid)"
                            " WHERE c.run_id = ? ORDER BY v.name, c.engine, c.scenario", [rid]),
            [("variant", "variant", str), ("engine", "engine", str), ("scenario", "scenario", str),
             ("US$/h", "usd_per_hour", fixed(2)), ("devices", "num_devices", str), ("out tok/s", "tokens_per_s", fixed(0)),
             ("US$ / M tokens", "usd_per_million_output_tokens", fixed(4)), ("SLO load", "slo_load", cell),
             ("US$ / M tokens at SLO", "usd_per_million_output_tokens_at_slo", fixed(4))],
            note="Price per device-hour from the run's price table (run_prices) × devices ÷ output tokens per hour."
                 " At SLO: the fastest serving load with at least the SLO's attainment share (default 90%) of its requests within it.",
        ),
        Section("levers", "Levers", _levers(speed), [
            ("variant", "variant", str), ("lever", "lever", str), ("engine", "engine", str),
            ("baseline", "baseline", str), ("with lever", "scenario", str), ("metric", "metric", str),
            ("baseline value", "base", fixed(2)), ("with lever value", "value", fixed(2)), ("change", "change", cell),
            ("note", "note", cell),
        ]),
        Section("speed", "All speed results", speed, [
            ("variant", "variant", str), ("engine", "engine", str), ("scenario", "scenario", str),
            ("status", "status", str), ("out tok/s", "tokens_per_s", fixed(0)), ("total tok/s", "total_tokens_per_s", fixed(0)),
            ("req/s", "requests_per_s", fixed(2)), ("TTFT ms", "ttft_ms", fixed(1)), ("TPOT ms", "tpot_ms", fixed(2)),
            ("E2EL ms", "e2el_ms", fixed(0)), ("reason", "reason", cell),
        ]),
    ]


# Each lever: (name, scenario with it, the scenario without it, the metric it should move).
LEVERS = [
    ("CUDA graphs off", "offline-eager", "offline", "tokens_per_s"),
    ("CUDA graphs off", "latency-eager", "latency", "tpot_ms"),
    ("prefix caching on", "prefix-on", "prefix-off", "tokens_per_s"),
    ("prefix caching on", "prefix-on", "prefix-off", "ttft_ms"),
    ("n-gram speculation", "latency-ngram", "latency", "tpot_ms"),
    ("static cache + torch.compile", "latency-compile", "latency", "tpot_ms"),
]


def _levers(speed: list[dict[str, Any]]) -> list[dict[str, Any]]:
    by = {(r["variant"], r["engine"], r["scenario"]): r for r in speed}
    out = []
    for lever, scenario, baseline, metric in LEVERS:
        for (variant, engine, name), r in by.items():
            base = by.get((variant, engine, baseline))
            if name != scenario or base is None:
                continue
            value, ref = r[metric], base[metric]
            change = f"{value / ref:.2f}×" if value is not None and ref else None
            details = json.loads(r["details"] or "{}")
            spec = details.get("spec_decode") or {}
            note = r["reason"] or base["reason"]
            if spec.get("acceptance_rate") is not None:
                note = f"draft acceptance {spec['acceptance_rate']:.0%}"
            out.append({"variant": variant, "lever": lever, "engine": engine, "baseline": baseline,
                        "scenario": scenario, "metric": metric, "base": ref, "value": value, "change": change,
                        "note": note})
    return out


def _offline(speed: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for r in speed:
        if r["scenario"] != "offline":
            continue
        row = out.setdefault(r["variant"], {"variant": r["variant"], "notes": []})
        if r["status"] == "ok":
            row[r["engine"]] = r["tokens_per_s"]
        else:
            row["notes"].append(f"{r['engine']} {r['status']}: {r['reason']}")
    for row in out.values():
        hf, vl = row.get("transformers"), row.get("vllm")
        row["ratio"] = vl / hf if hf and vl else None
        row["note"] = "; ".join(row.pop("notes")) or None
    return list(out.values())


def _run(con: Any, run_id: str | None) -> dict[str, Any] | None:
    if run_id:
        found = reads.rows(con, "SELECT * FROM runs WHERE run_id = ?", [run_id])
    else:
        found = reads.rows(con, "SELECT * FROM runs WHERE flow_name = 'gpu-suite' ORDER BY started_at DESC LIMIT 1")
    return found[0] if found else None


Column = tuple[str, str, Callable[[Any], str]]


@dataclass(frozen=True)
class Section:
    """One table of a summary: its rows and the columns shown of them (header, row key, format)."""

    key: str
    title: str
    rows: Sequence[dict[str, Any]]
    columns: Sequence[Column]
    note: str | None = None

    def markdown(self) -> list[str]:
        out = [f"## {self.title}", ""]
        if self.note:
            out += [self.note, ""]
        if not self.rows:
            return out + ["(none)", ""]
        out.append("| " + " | ".join(c[0] for c in self.columns) + " |")
        out.append("|" + "---|" * len(self.columns))
        for r in self.rows:
            out.append("| " + " | ".join("—" if r.get(key) is None else fmt(r[key]) for _, key, fmt in self.columns) + " |")
        return out + [""]

    def figures(self) -> list[dict[str, Any]]:
        """The values the table shows, unformatted: one mapping of row key to value per row."""
        keys = list(dict.fromkeys(key for _, key, _ in self.columns))
        return [{key: r.get(key) for key in keys} for r in self.rows]


def fixed(digits: int) -> Callable[[Any], str]:
    return lambda v: "—" if v is None else f"{v:,.{digits}f}"


def percent(v: float | None) -> str:
    return "—" if v is None else f"{100 * v:.1f}%"


def gib(v: int | None) -> str:
    return "—" if v is None else f"{v / GIB:.2f}"


def count(v: int | None) -> str:
    return "—" if v is None else f"{v:,}"


def cell(v: Any) -> str:
    return "" if v is None else str(v).replace("|", "/").replace("\n", " ")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("warehouse")
    parser.add_argument("--run-id")
    parser.add_argument("--parquet", help="also export every table to this folder")
    args = parser.parse_args(argv)
    with sessions.session(args.warehouse, read_only=True) as con:
        print(render(con, args.run_id))
        if args.parquet:
            transfer.export_parquet(con, args.parquet)


if __name__ == "__main__":
    main()
