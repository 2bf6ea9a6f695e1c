"""What a full garbage collection costs a measuring process before and after tasks.launch.freeze_heap: the heap
that process holds when its passes begin (quantgate's speed code with Prefect and pydantic, transformers, a tokenizer,
the prompt sets of the reference model's offline scenarios), each collection timed as the median of several.

    python benchmarks/gc_heap.py [TOKENIZER_FOLDER]     # default: the tiny shared model's tokenizer
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
from pathlib import Path


def full_collection_ms(times: int = 7) -> float:
    runs = []
    for _ in range(times):
        began = time.perf_counter()
        gc.collect()
        runs.append((time.perf_counter() - began) * 1000)
    return statistics.median(runs)


def main() -> None:
    import quantgate.tasks.steps.benchmark  # noqa: F401 - the measuring process's imports
    from quantgate.catalog.scenarios import OfflineScenario
    from quantgate.tasks.adapters.speed.prompts import make_prompt_sets
    from quantgate.tasks.runtime.launch import freeze_heap

    tokenizer = sys.argv[1] if len(sys.argv) > 1 else str(
        Path(__file__).resolve().parents[1].parent / "shared" / "data" / "models" / "stories260k-i256")
    held = [make_prompt_sets(OfflineScenario(num_prompts=n, input_len=i, output_len=o, warmup=1, repetitions=3), tokenizer, 4)
            for n, i, o in [(128, 256, 128), (1000, 256, 128), (500, 752, 16)]]
    tracked = len(gc.get_objects())
    before = full_collection_ms()
    frozen = freeze_heap()
    after = full_collection_ms()
    print(f"objects tracked by the collector: {tracked:,}; frozen: {frozen:,}; prompt sets held: {len(held)}")
    print(f"a full collection: {before:.1f} ms before the freeze, {after:.3f} ms after")


if __name__ == "__main__":
    main()
