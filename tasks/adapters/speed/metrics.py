"""Throughput, latency percentiles and goodput at an SLO of one load run.

Metric definitions follow vLLM's serving benchmark (vllm/benchmarks/lib/endpoint_request_func.py and
vllm/benchmarks/serve.py, vLLM 0.26): TTFT is the time to the first streamed chunk that carries a
choice; ITL is the gap between consecutive such chunks (one per chunk, so a chunk that carries several
tokens gives one gap); E2EL ends at the last such chunk; the output token count comes from the final
usage chunk and TPOT = (E2EL - TTFT) / (output tokens - 1).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from quantgate.catalog.records import RequestRecord, Slo

PERCENTILES = (50, 90, 99)


def summarize(records: list[RequestRecord], duration_s: float, slo: Slo | None = None) -> dict[str, Any]:
    """Throughput and latency percentiles of one load run, in vLLM's definitions (milliseconds)."""
    ok = [r for r in records if r.success]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    summary: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": duration_s,
        "input_tokens": in_tokens,
        "output_tokens": out_tokens,
        "requests_per_s": len(ok) / duration_s,
        "output_tokens_per_s": out_tokens / duration_s,
        "total_tokens_per_s": (in_tokens + out_tokens) / duration_s,
    }
    series = {
        "ttft": [r.ttft_s for r in ok],
        "tpot": [r.tpot_s for r in ok if r.tpot_s is not None],
        "itl": [gap for r in ok for gap in r.itl_s],
        "e2el": [r.e2el_s for r in ok],
    }
    for name, values in series.items():
        ms = np.asarray(values, dtype=float) * 1000
        summary[f"{name}_ms_mean"] = float(ms.mean()) if ms.size else None
        for p in PERCENTILES:
            summary[f"{name}_ms_p{p}"] = float(np.percentile(ms, p)) if ms.size else None
    if slo is not None:
        good = sum(1 for r in ok if _meets(r, slo))
        summary["slo"] = {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms, "e2el_ms": slo.e2el_ms}
        summary["good_requests"] = good
        summary["goodput_requests_per_s"] = good / duration_s
    return summary


def _meets(r: RequestRecord, slo: Slo) -> bool:
    # As in vLLM: a request with one output token has TPOT 0 for goodput.
    checks = ((slo.ttft_ms, r.ttft_s), (slo.tpot_ms, r.tpot_s or 0.0), (slo.e2el_ms, r.e2el_s))
    return all(limit is None or value * 1000 <= limit for limit, value in checks)

