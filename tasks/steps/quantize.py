"""Build quantized variants of a model, once per distinct (model, recipe, calibration, library versions).

A build lands in `out_root/<variant uid>/`. It is written into a temporary sibling folder and moved
into place only when complete, with a marker file written last, so a half-written checkpoint is
never reused. A per-variant failure is returned as a `VariantArtifact` with status "failed".
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import resource
import shutil
import socket
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from prefect import task
from safetensors import safe_open

from quantgate.catalog.errors import one_line
from quantgate.catalog.families import model_family
from quantgate.catalog.records import CalibrationSamples, ModelArtifact, VariantArtifact
from quantgate.catalog.variants import CalibrationSpec, VariantSpec
from quantgate.tasks.adapters import model_memory
from quantgate.tasks.runtime import faults, launch
from quantgate.tasks.runtime.environment import library_versions
from quantgate.tasks.steps.calibration import load_calibration

log = logging.getLogger(__name__)

MARKER = ".quantgate-variant.json"
UID_LIBS = ("llmcompressor", "compressed-tensors", "transformers")
# A load-time (bitsandbytes) variant is made by these at every load.
LOAD_TIME_LIBS = ("bitsandbytes", "transformers")


def lib_versions() -> dict[str, str]:
    """Library versions of a build: the quantizer's (UID_LIBS) and torch, all required."""
    return library_versions((*UID_LIBS, "torch"), required=True)


def load_time_versions() -> dict[str, str]:
    """Library versions of a load-time variant; bitsandbytes is "absent" where it is not installed."""
    bnb = library_versions(["bitsandbytes"]).get("bitsandbytes", "absent")
    return {"bitsandbytes": bnb, **library_versions(["transformers", "torch"], required=True)}


def recipe_for(spec: VariantSpec) -> tuple[str, str]:
    """(recipe YAML, its sha256) for a spec; builds the modifier objects, runs nothing. A load-time
    variant's recipe is its bitsandbytes config (JSON)."""
    if spec.load_time:
        from quantgate.tasks.adapters.loadtime import recipe_text as load_time_recipe

        text = load_time_recipe(spec)
        return text, hashlib.sha256(text.encode()).hexdigest()
    # Imported here: llmcompressor takes seconds to import and only builds need it.
    from quantgate.tasks.adapters.quantizers.llmcompressor import recipe_text

    text = recipe_text(spec)
    return text, hashlib.sha256(text.encode()).hexdigest()


def for_family(model: ModelArtifact, spec: VariantSpec, serving: str | None = None) -> tuple[VariantSpec, str | None]:
    """`spec` as `model`'s family builds it (the modules the family keeps in 16 bits added to its `ignore`:
    catalog/families.yaml) and why the family refuses it (one line), or None; `serving` "vllm" (the run evaluates
    with vLLM) adds what vLLM cannot load. A family that keeps nothing more, or a model of no listed
    family, gets the very spec: its recipe and uid, so its stored builds, stay as they were."""
    family = model_family(model.path)
    if family is None:
        return spec, None
    return family.apply(spec), family.refusal(spec, serving)


def variant_uid(
    model: ModelArtifact, recipe_hash: str, versions: dict[str, str], calibration: str | None = None,
    libs: tuple[str, ...] = UID_LIBS,
) -> str:
    """16 hex chars of sha256 over the model sha, recipe hash, quantizer library versions (`libs`) and,
    for calibrated methods, the calibration fingerprint (the data changes the weights)."""
    key = {"model": model.sha, "recipe": recipe_hash, "libs": {k: versions[k] for k in libs}}
    if calibration is not None:
        key["calibration"] = calibration
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def weights_bytes(folder: str | Path) -> int:
    folder = Path(folder)
    files = [*folder.glob("*.safetensors"), *folder.glob("pytorch_model*.bin")]
    return sum(f.stat().st_size for f in files)


def base_variant(model: ModelArtifact) -> VariantArtifact:
    return VariantArtifact(
        uid=f"{model.uid}:base",
        model_uid=model.uid,
        name="base",
        method="base",
        scheme=None,
        bits=None,
        group_size=None,
        path=model.path,
        recipe=None,
        recipe_hash=None,
        size_bytes=weights_bytes(model.path),
    )


def _nonfinite_tensor(folder: Path) -> str | None:
    import torch

    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                # float() because isfinite has no float8 kernel
                if t.is_floating_point() and not torch.isfinite(t.float()).all():
                    return name
    return None


def _owner() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def _sweep_orphans(out_root: Path, uid: str) -> None:
    """Remove temporary build folders of `uid` left by killed processes of this host (their pid is gone);
    a build still running elsewhere keeps its folder."""
    host = socket.gethostname()
    for tmp in out_root.glob(f".{uid}.*.tmp"):
        owner = tmp.name[len(uid) + 2:].split(".", 1)[0]
        owner_host, _, pid = owner.rpartition("-")
        if owner_host != host or not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            log.info("removing %s, left by a build that was killed", tmp)
            shutil.rmtree(tmp, ignore_errors=True)
        except PermissionError:
            pass


def _build_error(err: BaseException) -> str:
    from quantgate.tasks.adapters.quantizers.llmcompressor import QuantizeError

    # Our own checks (the disk's included) already read as a sentence; anything else keeps its exception type.
    ours = isinstance(err, (QuantizeError, model_memory.CapacityError)) and str(err).strip()
    return str(err).strip().splitlines()[0][:300] if ours else one_line(err)


def _reusable(folder: Path, spec: VariantSpec, uid: str,
              existing: Callable[[str], dict | None] | None) -> VariantArtifact | None:
    """A finished build of this uid: the one in `folder` (its marker), else the warehouse row `existing` finds."""
    if (found := _from_marker(folder, spec)) is not None:
        return found
    row = existing(uid) if existing is not None else None
    return _from_row(row, spec) if row is not None else None


def _from_marker(folder: Path, spec: VariantSpec) -> VariantArtifact | None:
    marker = folder / MARKER
    if not marker.is_file():
        return None
    art = VariantArtifact(**json.loads(marker.read_text()))
    return replace(art, name=spec.name, path=str(folder), reused=True)


def _from_row(row: dict[str, Any], spec: VariantSpec) -> VariantArtifact | None:
    if row.get("status") != "built" or not row.get("path") or not (Path(row["path"]) / "config.json").is_file():
        return None
    if spec.load_time:
        from quantgate.tasks.adapters.loadtime import LOAD_FILE

        if not (Path(row["path"]) / LOAD_FILE).is_file():
            return None
    versions = row.get("lib_versions") or {}
    return VariantArtifact(
        uid=row["variant_uid"],
        model_uid=row["model_uid"],
        name=spec.name,
        method=row["method"],
        scheme=row.get("scheme"),
        bits=row.get("bits"),
        group_size=row.get("group_size"),
        path=row["path"],
        recipe=row.get("recipe"),
        recipe_hash=row.get("recipe_hash"),
        lib_versions=json.loads(versions) if isinstance(versions, str) else dict(versions),
        size_bytes=row.get("size_bytes"),
        build_seconds=row.get("build_seconds"),
        peak_memory_bytes=row.get("peak_memory_bytes"),
        reused=True,
    )


def variant_from_row(row: dict[str, Any], spec: VariantSpec) -> VariantArtifact | None:
    """A run's stored variant (built or failed, `reused` as the run recorded it); None for a built
    variant whose folder is gone (it must be built again)."""
    if row.get("status") == "built":
        found = _from_row(row, spec)
        return None if found is None else replace(found, reused=bool(row.get("reused")))
    versions = row.get("lib_versions") or {}
    return VariantArtifact(
        uid=row["variant_uid"], model_uid=row["model_uid"], name=spec.name, method=row["method"],
        scheme=row.get("scheme"), bits=row.get("bits"), group_size=row.get("group_size"), path=None,
        recipe=row.get("recipe"), recipe_hash=row.get("recipe_hash"),
        lib_versions=json.loads(versions) if isinstance(versions, str) else dict(versions),
        build_seconds=row.get("build_seconds"), status="failed", error=row.get("error"), reused=bool(row.get("reused")),
    )


def quantize_measured(model_path: Path, spec: VariantSpec, samples: CalibrationSamples | None, out: Path) -> int:
    """llm-compressor's build of `spec` into `out`; returns the peak memory it took (GPU allocator, else the
    process's resident set: on a CPU that is the process's peak so far, not this build's alone)."""
    import torch

    from quantgate.tasks.adapters.quantizers.llmcompressor import quantize

    on_gpu = torch.cuda.is_available()
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    quantize(model_path, spec, samples, out)
    faults.point("build", spec.name)  # where a GPU fault test holds a build, this process's GPU memory still taken
    return _peak_memory_bytes(on_gpu)


def _peak_memory_bytes(on_gpu: bool) -> int:
    import torch

    if on_gpu:
        return torch.cuda.max_memory_allocated()
    # ru_maxrss is in KiB on Linux and is the process's peak so far, not this build's alone.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _build_checked(
    model: ModelArtifact, spec: VariantSpec, samples: CalibrationSamples | None, tmp: Path
) -> tuple[int | None, str | None]:
    """Build `spec` of `model` into `tmp` and check what it wrote: (its peak memory, None), or (None, why it failed
    in one line). Any failure of this one build is recorded, not raised."""
    import torch

    from quantgate.tasks.adapters import logit_check

    on_gpu = torch.cuda.is_available()
    # What it will write, against the disk's free space less what builds under way here have yet to write: one line
    # when short, before any work (a CPU build keeps its unquantized tensors in float32).
    disk = model_memory.variant_disk_bytes(model.path, spec, dtype_bytes=2 if on_gpu else 4)
    try:
        with model_memory.disk_reserved(tmp, disk, "its build"):
            if on_gpu:
                # A process of its own: builds of one model then run side by side on the GPU (llm-compressor keeps
                # one global session per process), and each build's peak memory is its own.
                peak = launch.on_gpus(None, None, quantize_measured, Path(model.path), spec, samples, tmp)
            else:
                peak = quantize_measured(Path(model.path), spec, samples, tmp)
        faults.point("quantize")
        if (bad := _nonfinite_tensor(tmp)) is not None:
            return None, f"saved weights contain NaN/Inf in {bad}"
        # Cheap, before any evaluation: a checkpoint that loads wrong or computes what its base does not fails here.
        problem = logit_check.checkpoint_problem(model.path, tmp, spec.scheme, model.random_weights)
        return (peak, None) if problem is None else (None, problem)
    except Exception as e:
        log.warning("variant %s (%s) failed", spec.name, tmp.name, exc_info=True)
        return None, _build_error(e)


def build_variant(
    model: ModelArtifact,
    spec: VariantSpec,
    calib: CalibrationSpec,
    out_root: Path,
    existing: Callable[[str], dict | None] | None = None,
    serving: str | None = None,
) -> VariantArtifact:
    """Build `spec` of `model` under `out_root`, or return the earlier build of the same uid (reused=True).

    `existing(uid)` may return the warehouse's row for the uid; a built row whose folder still
    exists is reused too. `serving`: the engine the run evaluates with ("vllm" refuses what vLLM
    cannot load, before any work). A load-time spec (bitsandbytes) goes to `build_load_time`.
    """
    if spec.load_time:
        return build_load_time(model, spec, out_root, existing)
    spec, refused = for_family(model, spec, serving)
    versions = lib_versions()
    recipe, recipe_hash = recipe_for(spec)
    # A variant its family refuses is refused before any work: not even its calibration is read.
    samples = load_calibration(calib, model.path) if spec.needs_calibration and refused is None else None
    uid = variant_uid(model, recipe_hash, versions, samples.fingerprint if samples else None)
    out_root = Path(out_root)
    final = out_root / uid

    if refused is None and (reused := _reusable(final, spec, uid, existing)) is not None:
        return reused

    built = VariantArtifact(
        uid=uid, model_uid=model.uid, name=spec.name, method=spec.method, scheme=spec.scheme, bits=spec.bits,
        group_size=spec.group_size, path=str(final), recipe=recipe, recipe_hash=recipe_hash, lib_versions=versions,
    )
    if refused is not None:
        return replace(built, path=None, status="skipped", error=f"{spec.name}: {refused}")
    out_root.mkdir(parents=True, exist_ok=True)
    _sweep_orphans(out_root, uid)
    tmp = Path(tempfile.mkdtemp(prefix=f".{uid}.{_owner()}.", suffix=".tmp", dir=out_root))
    start = time.perf_counter()
    peak, error = _build_checked(model, spec, samples, tmp)
    if error is not None:
        shutil.rmtree(tmp, ignore_errors=True)
        return replace(
            built, path=None, status="failed", error=f"{spec.name}: {error}", build_seconds=time.perf_counter() - start
        )
    built = replace(built, size_bytes=weights_bytes(tmp), build_seconds=time.perf_counter() - start,
                    peak_memory_bytes=peak)
    return _publish(built, tmp, final, spec)


def load_time_uid(model: ModelArtifact, spec: VariantSpec) -> str:
    """Uid of a load-time variant: base sha + bitsandbytes config + bitsandbytes and transformers versions."""
    _, recipe_hash = recipe_for(for_family(model, spec)[0])
    return variant_uid(model, recipe_hash, load_time_versions(), libs=LOAD_TIME_LIBS)


def build_load_time(
    model: ModelArtifact,
    spec: VariantSpec,
    out_root: Path,
    existing: Callable[[str], dict | None] | None = None,
) -> VariantArtifact:
    """A bitsandbytes variant: no checkpoint is written. The base is loaded once with the config on this
    machine's device (CUDA when there is one) to check that it loads and that its logits are close to the base's
    (tasks/adapters/logit_check.py), and to measure its size in memory (Transformers' footprint of parameters and
    buffers in the checkpoint's dtype, the counterpart of the base's size on disk). The variant's folder then holds
    the base's small files and the config (tasks.loadtime). Where bitsandbytes cannot run here, or the model's family
    refuses it, the variant is "skipped"."""
    import torch

    from quantgate.tasks.adapters import loadtime, logit_check

    spec, refused = for_family(model, spec)
    versions = load_time_versions()
    recipe, recipe_hash = recipe_for(spec)
    uid = variant_uid(model, recipe_hash, versions, libs=LOAD_TIME_LIBS)
    final = Path(out_root) / uid
    if refused is None and (reused := _reusable(final, spec, uid, existing)) is not None:
        return reused
    built = VariantArtifact(
        uid=uid, model_uid=model.uid, name=spec.name, method=spec.method, scheme=spec.scheme, bits=spec.bits,
        group_size=None, path=str(final), recipe=recipe, recipe_hash=recipe_hash, lib_versions=versions,
    )
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if (why := refused or loadtime.unavailable(device)) is not None:
        return replace(built, path=None, status="skipped", error=f"{spec.name}: {why}")
    Path(out_root).mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{uid}.", suffix=".tmp", dir=out_root))
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    try:
        loadtime.write_folder(tmp, model.path, spec)
        loaded = loadtime.load_model(tmp, device=device, dtype="auto")
        size = int(loaded.get_memory_footprint())
        error = logit_check.loaded_problem(loaded, model.path, spec.scheme, model.random_weights)
        del loaded
    except Exception as e:  # this variant fails alone
        log.warning("variant %s (%s) failed", spec.name, uid, exc_info=True)
        error = one_line(e)
    seconds = time.perf_counter() - start
    if error is not None:
        shutil.rmtree(tmp, ignore_errors=True)
        return replace(built, path=None, status="failed", error=f"{spec.name}: {error}", build_seconds=seconds)
    built = replace(built, size_bytes=size, build_seconds=seconds, peak_memory_bytes=_peak_memory_bytes(device == "cuda"))
    return _publish(built, tmp, final, spec)


def _publish(built: VariantArtifact, tmp: Path, final: Path, spec: VariantSpec) -> VariantArtifact:
    """Write the marker into the finished build folder and rename it into place."""
    record = asdict(built)
    del record["reused"]
    (tmp / MARKER).write_text(json.dumps(record, indent=2))
    if final.exists() and not (final / MARKER).is_file():
        shutil.rmtree(final)  # not ours to trust: no marker means it was never completed
    try:
        os.replace(tmp, final)
    except OSError:
        # Another process finished the same build first; keep its copy.
        shutil.rmtree(tmp, ignore_errors=True)
        if (other := _from_marker(final, spec)) is None:
            raise
        return other
    return built


build_variant_task = task(build_variant, name="quantize", tags=["quantize"])
