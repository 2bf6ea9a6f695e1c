"""The GPU machine's Python packages, from the GPU lock (requirements/gpu.txt): built here, installed there.

The device has no network and takes 64 MiB a call, so the lock's wheels travel in parts:

    python benchmarks/gpu/lock_kit.py build                 # here: .lockkit/part01 ... (ignored by git)
    python3 benchmarks/gpu/lock_kit.py install .lockkit/partNN ...   # there: the parts of each call, back to back
    python benchmarks/gpu/lock_kit.py pip-flags             # pip's flags for a GPU host's wheels (make lock-check)

`build` takes every pin of the lock but the GPU host's platform, which its image already holds: the CUDA build of
torch (torch, torchvision, torchaudio, triton) and CUDA's libraries (nvidia-*, cuda-*), and any package that
benchmarks/gpu/device-image.txt (the image's `pip list --format=freeze`) holds at the locked version. A wheel larger
than a part is cut into chunks. `install` moves a part's files out of the repository copy (so later calls on the
same machine keep them), puts cut wheels together, checks every wheel's sha256, installs what is complete into
/root/qg-lock/site-packages (the folder benchmarks/gpu/env.sh puts first on the path) and, once every wheel is in, prints the
environment's drift from the lock: every locked package there at another version (the image's platform included),
as `LOCK: drift ...` lines, and `LOCK: COMPLETE`."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from tasks.runtime.environment import canonical, drift, installed, pins  # noqa: E402  (no install needed there)

LOCK = REPO / "requirements/gpu.txt"
IMAGE = Path(__file__).with_name("device-image.txt")
PLATFORM = ("torch", "torchvision", "torchaudio", "triton")
PLATFORM_PREFIXES = ("nvidia-", "cuda-")
# The one list of these, and of the tags below: `make lock-check` reads them through `pip-flags`.
SDIST_ONLY = ("rouge-score", "sqlitedict", "word2number")  # lm-eval's pure Python, sources only on the registry
# A GPU host's wheel tags: x86-64, glibc 2.31 (the GPU lock is compiled for x86_64-manylinux_2_31; llguidance needs it).
TAGS = [f"manylinux_2_{n}_x86_64" for n in range(5, 32)] + ["manylinux2014_x86_64", "manylinux1_x86_64"]
HOST = ["--python-version", "3.12", "--implementation", "cp", *(a for t in TAGS for a in ("--platform", t))]
# Outside the repository copy, so that later calls on the same machine keep them; env.sh reads QG_LOCK_SITE too.
# The folder's path must contain "site-packages": dill (datasets' fingerprints of lm-eval's tasks) pickles a module
# by value unless its file is under sys.prefix, an extension module or in a path containing "site-packages", and
# pyarrow pickled by value fails ("Can't pickle <class 'MonthDayNano'>"): seen on an H100 with /root/devkit-site.
STAGE = Path(os.environ.get("QG_LOCK_STAGE", "/root/qg-lock/stage"))
SITE = Path(os.environ.get("QG_LOCK_SITE", "/root/qg-lock/site-packages"))


def carried(lock: dict[str, str], image: dict[str, str]) -> dict[str, str]:
    """The pins a GPU host's image does not already meet."""
    return {n: v for n, v in lock.items()
            if n not in PLATFORM and not n.startswith(PLATFORM_PREFIXES) and image.get(n) != v}


def build(out: Path, part_mib: int) -> None:
    image = pins(IMAGE) if IMAGE.exists() else {}
    wanted = carried(pins(LOCK), image)
    wheels = out / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    pip = [sys.executable, "-m", "pip"]
    binary = [f"{n}=={v}" for n, v in wanted.items() if n not in SDIST_ONLY]
    sources = [f"{n}=={v}" for n, v in wanted.items() if n in SDIST_ONLY]
    subprocess.run([*pip, "download", "-q", "--no-deps", "--only-binary=:all:", *HOST, "-d", str(wheels), *binary],
                   check=True)
    if sources:
        subprocess.run([*pip, "wheel", "-q", "--no-deps", "-w", str(wheels), *sources], check=True)
    files = sorted((f for f in wheels.glob("*.whl") if canonical(f.name.split("-")[0]) in wanted),
                   key=lambda f: -f.stat().st_size)
    missing = set(wanted) - {canonical(f.name.split("-")[0]) for f in files}
    if missing:
        sys.exit(f"error: no wheel for {sorted(missing)}")
    for old in out.glob("part*"):
        shutil.rmtree(old)
    manifest = {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in files}
    limit = part_mib << 20
    parts: list[list[tuple[Path, str, int, int]]] = [[]]
    room = limit
    # Cut wheels first (a chunk per part), then the rest first-fit, largest first, into what room is left.
    for f in files:
        size = f.stat().st_size
        if size > limit:
            n = -(-size // limit)
            for k in range(n):
                parts.append([(f, f"{f.name}.split-{k + 1:02d}-of-{n:02d}", k * limit, min(limit, size - k * limit))])
            continue
        fit = next((p for p in parts if sum(c[3] for c in p) + size <= limit), None)
        if fit is None:
            parts.append(fit := [])
        fit.append((f, f.name, 0, size))
    parts = [p for p in parts if p]
    for i, part in enumerate(parts, start=1):
        folder = out / f"part{i:02d}"
        folder.mkdir()
        for src, name, start, length in part:
            with open(src, "rb") as fin, open(folder / name, "wb") as fout:
                fin.seek(start)
                fout.write(fin.read(length))
        (folder / "MANIFEST.json").write_text(json.dumps(manifest, indent=0))
    size = sum(f.stat().st_size for f in files) >> 20
    print(f"lock_kit: {len(files)} wheels ({size} MiB) of {len(pins(LOCK))} locked packages in {len(parts)} parts of "
          f"<= {part_mib} MiB under {out}; the image meets the rest" + ("" if image else " (no device-image.txt)"))


def install(parts: list[Path]) -> None:
    incoming, done_list = STAGE / "incoming", SITE / ".lock-installed"
    incoming.mkdir(parents=True, exist_ok=True)
    SITE.mkdir(parents=True, exist_ok=True)
    done = set(done_list.read_text().split()) if done_list.exists() else set()
    for f in (f for part in parts for f in part.iterdir()):
        if f.name == "MANIFEST.json":
            shutil.copy(f, STAGE / f.name)
        else:
            shutil.move(str(f), incoming / f.name)
    manifest = json.loads((STAGE / "MANIFEST.json").read_text())
    for first in incoming.glob("*.split-01-of-*"):
        whl, n = first.name.split(".split-01-of-")
        chunks = sorted(incoming.glob(f"{whl}.split-*-of-{n}"))
        if len(chunks) == int(n):
            with open(incoming / whl, "wb") as out:
                for c in chunks:
                    out.write(c.read_bytes())
            for c in chunks:
                c.unlink()
    ready = []
    for w in sorted(incoming.glob("*.whl")):
        if hashlib.sha256(w.read_bytes()).hexdigest() != manifest.get(w.name):
            print(f"LOCK: error: sha256 of {w.name} is not the manifest's; removed, carry its part again")
            w.unlink()
        else:
            ready.append(w)
    if ready:
        target = STAGE / "target"
        shutil.rmtree(target, ignore_errors=True)
        pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                              "--no-cache-dir", "--target", str(target), *map(str, ready)], capture_output=True, text=True)
        if pip.returncode:
            sys.exit(f"LOCK: error: pip could not install {len(ready)} wheels (kept for the next call): "
                     f"{(pip.stderr.strip().splitlines() or ['?'])[-1]}")
        # Merged rather than a second `pip --target` into the same folder, which would skip an existing bin/.
        shutil.copytree(target, SITE, dirs_exist_ok=True, symlinks=True)
        shutil.rmtree(target)
        for w in ready:
            done.add(w.name)
            w.unlink()
        done_list.write_text("\n".join(sorted(done)))
    left = sorted(set(manifest) - done)
    print(f"LOCK: {len(ready)} installed this call; {len(manifest) - len(left)} of {len(manifest)} wheels in {SITE}")
    if left:
        print(f"LOCK: waiting for {len(left)}: {' '.join(n.split('-')[0] for n in left[:12])}")
        return
    sys.path.insert(0, str(SITE))
    differs = drift(pins(LOCK), installed())
    for line in differs:
        print(f"LOCK: drift {line}")
    print(f"LOCK: COMPLETE, {len(differs)} locked packages differ from requirements/gpu.txt")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="here: the lock's wheels in parts")
    b.add_argument("--out", type=Path, default=REPO / ".lockkit")
    b.add_argument("--part-mib", type=int, default=50)
    i = sub.add_parser("install", help="on the device: the parts this call carries")
    i.add_argument("parts", type=Path, nargs="+")
    sub.add_parser("pip-flags", help="pip's flags for the GPU host's wheels, the sources-only packages as sources")
    args = parser.parse_args()
    if args.command == "pip-flags":
        print(" ".join([*HOST, "--no-binary", ",".join(SDIST_ONLY)]))
    else:
        build(args.out, args.part_mib) if args.command == "build" else install(args.parts)


if __name__ == "__main__":
    main()
