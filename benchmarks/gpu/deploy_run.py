"""Start the nightly through its deployment for one model and wait for the evaluate-model run it submits; print and
write (as markdown) the flow runs, where each ran and the time to decisions. Used by benchmarks/gpu/deploy.sh:

    python3 benchmarks/gpu/deploy_run.py MODEL TIMEOUT_S OUT.md [CATALOG]
"""

from __future__ import annotations

import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags
from prefect.deployments import run_deployment

FINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


def main(model: str, timeout_s: float, out: Path, catalog: str | None = None) -> int:
    submitted = datetime.now(timezone.utc)
    params = {"models": [model], "all_models": True, **({"catalog": catalog} if catalog else {})}
    nightly = run_deployment("nightly/nightly", parameters=params, timeout=0)
    print(f"nightly {nightly.id} submitted at {submitted:%H:%M:%S}", flush=True)
    deadline = time.monotonic() + timeout_s
    evaluate = None
    with get_client(sync_client=True) as client:
        while time.monotonic() < deadline:
            if evaluate is None:
                found = client.read_flow_runs(flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=["nightly",
                                                                                                        f"model:{model}"])))
                evaluate = next((r for r in found if r.id != nightly.id), None)
            if evaluate is not None:
                evaluate = client.read_flow_run(evaluate.id)
                if evaluate.state and evaluate.state.type.value in FINAL:
                    break
            time.sleep(3)
        else:
            if evaluate is not None:
                from prefect.states import Cancelling

                client.set_flow_run_state(evaluate.id, Cancelling(message=f"deploy.sh: past {timeout_s:.0f} s"))
                print(f"evaluate-model not done after {timeout_s:.0f} s: cancelled", flush=True)
        runs = [client.read_flow_run(nightly.id)] + ([client.read_flow_run(evaluate.id)] if evaluate else [])
    lines = ["| flow run | pool | state | started | ended | seconds |", "|---|---|---|---|---|---|"]
    for r in runs:
        ended = r.start_time and r.end_time
        lines.append(f"| {r.name} | {r.work_pool_name or '—'} | {r.state.type.value if r.state else '—'} | "
                     + (f"{r.start_time:%H:%M:%S} | {r.end_time:%H:%M:%S} | {(r.end_time - r.start_time).total_seconds():.1f} |"
                        if ended else "— | — | — |"))
    text = "\n".join(lines)
    if evaluate is not None and evaluate.end_time is not None:
        total = (evaluate.end_time - submitted).total_seconds()
        text = (f"Time to decisions, from the nightly's submission to the end of its evaluate-model run: **{total:.1f} s**"
                f" (the evaluate-model run itself: {(evaluate.end_time - evaluate.start_time).total_seconds():.1f} s).\n\n"
                + text)
    out.write_text(text + "\n")
    print(text, flush=True)
    return 0 if evaluate is not None and evaluate.state.type.value == "COMPLETED" else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], float(sys.argv[2]), Path(sys.argv[3]), *sys.argv[4:5]))
