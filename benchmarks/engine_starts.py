"""Where each engine start of a run spent its time, from vLLM's own log lines: one row per engine or server log.

    python benchmarks/engine_starts.py WORKDIR [--out engine-starts.md]

The measurement phase of a large model is mostly engine starts (a 7B shape's on the H100: a `vllm serve` start
took 70-90 s beside other work), which the warehouse sees only as waits and engine counts. vLLM logs what each
start did: its weights read, its model loaded (GiB and seconds), torch.compile, CUDA-graph capture, its KV cache
and warm-up. This reads every `*.log` under WORKDIR's `serving-logs/` and the engine logs beside them (not the
run's own log, whose evaluation engines are in the stage times) and tables those figures with the log's first
and last timestamp. A line vLLM did not write (an eager engine captures no graphs) is left empty.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

# vLLM 0.26's lines, e.g. "Loading weights took 2.24 seconds", "Model loading took 14.29 GiB and 5.07 seconds",
# "torch.compile takes 10.49 s in total", "Graph capturing finished in 5 secs, took 0.53 GiB",
# "init engine (profile, create kv cache, warmup model) took 2.63 s", "GPU KV cache size: 149,792 tokens".
FIGURES = {
    "weights_s": re.compile(r"Loading weights took ([\d.]+) seconds"),
    "model_gib": re.compile(r"Model loading took ([\d.]+) GiB"),
    "model_s": re.compile(r"Model loading took [\d.]+ GiB and ([\d.]+) seconds"),
    "compile_s": re.compile(r"torch\.compile takes ([\d.]+) s in total"),
    "graphs_s": re.compile(r"Graph capturing finished in ([\d.]+) secs"),
    "init_engine_s": re.compile(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s"),
    "kv_tokens": re.compile(r"GPU KV cache size: ([\d,]+) tokens"),
}
STAMP = re.compile(r"^(?:\(\w+ pid=\d+\) )?(?:INFO|WARNING|ERROR|DEBUG) (\d\d-\d\d \d\d:\d\d:\d\d)")


@dataclass
class EngineStart:
    log: str
    figures: dict[str, str]
    first: datetime | None
    last: datetime | None

    @property
    def span_s(self) -> float | None:
        return (self.last - self.first).total_seconds() if self.first and self.last else None


def read_start(path: Path, root: Path) -> EngineStart:
    """The figures of one engine or server log (the first of each: a paired session's base loads first)."""
    figures: dict[str, str] = {}
    first = last = None
    for line in path.read_text(errors="replace").splitlines():
        if (stamp := STAMP.match(line)) is not None:
            at = datetime.strptime(stamp.group(1), "%m-%d %H:%M:%S")
            first, last = first or at, at
        for name, pattern in FIGURES.items():
            if name not in figures and (found := pattern.search(line)) is not None:
                figures[name] = found.group(1).replace(",", "")
    return EngineStart(str(path.relative_to(root)), figures, first, last)


def engine_logs(workdir: Path) -> list[Path]:
    """The speed engines' and servers' logs of a run's work dir, in path order."""
    return sorted(p for p in workdir.rglob("*.log")
                  if "serving-logs" in p.parts and "results" not in p.relative_to(workdir).parts[:1])


def table(starts: list[EngineStart]) -> str:
    columns = ["log", *FIGURES, "logged_s"]
    rows = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for s in starts:
        span = f"{s.span_s:.0f}" if s.span_s is not None else ""
        rows.append("| " + " | ".join([s.log, *(s.figures.get(name, "") for name in FIGURES), span]) + " |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workdir", type=Path)
    parser.add_argument("--out", type=Path, help="write the table here (markdown) as well as printing it")
    args = parser.parse_args()
    text = table([read_start(p, args.workdir) for p in engine_logs(args.workdir)])
    print(text)
    if args.out:
        args.out.write_text(f"# Engine starts of {args.workdir}\n\n{text}\n")


if __name__ == "__main__":
    main()
