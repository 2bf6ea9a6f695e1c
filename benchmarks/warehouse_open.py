"""What a warehouse session costs to open: writable with the views as the warehouse holds them (the normal
case), writable with every view recreated (what each writable open did before the views' checksum, and
still does after their SQL changes), and read-only. Side by side in one run, on a fresh warehouse:

    .venv/bin/python benchmarks/warehouse_open.py [--opens 50]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from quantgate.warehouse import sessions


def ms_per_open(path: Path, opens: int, read_only: bool = False, recreate_views: bool = False) -> float:
    start = time.perf_counter()
    for _ in range(opens):
        with sessions.session(path, read_only=read_only) as con:
            if recreate_views:
                sessions.apply_views(con, force=True)
    return (time.perf_counter() - start) / opens * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--opens", type=int, default=50)
    opens = parser.parse_args().opens
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "w.ducklake"
        with sessions.session(path):
            pass  # migrations and views, once
        kept = ms_per_open(path, opens)
        recreated = ms_per_open(path, opens, recreate_views=True)
        read_only = ms_per_open(path, opens, read_only=True)
    print(f"writable, views kept:      {kept:6.1f} ms per open")
    print(f"writable, views recreated: {recreated:6.1f} ms per open ({recreated / kept:.1f}x)")
    print(f"read-only:                 {read_only:6.1f} ms per open")


if __name__ == "__main__":
    main()
