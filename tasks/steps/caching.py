"""Prefect task caching for the download, calibration check and quantize steps, kept under the work dir.

A download is keyed by what identifies the checkpoint before fetching it (a hub commit sha, a local
folder's content hash, a GGUF checkpoint's identity and the transformers version); a build by the variant uid,
which is the model sha + recipe hash + quantizer library versions (+ the calibration data; for a
bitsandbytes variant, its config and the bitsandbytes and transformers versions), itself kept by its inputs
(`remembered_quantize_key`) since computing it takes llm-compressor and the tokenizer; a calibration check by
what its verdict depends on (see `calibration_check_key`), and only a pass is kept: a refusal is a failed task,
which leaves no record, so an overlapping set is refused on every run. Cache
records and results live in `<workdir>/cache/`, so every run and every worker that shares the work
dir shares them, and a run that crashed resumes at the first step without a cache record.

A cache hit is only trusted when the checkpoint it names is still on disk (and, for a build, when
the build succeeded); otherwise the step runs again and refreshes the record. Builds keep their own
reuse (marker file, warehouse row) beneath this: the cache only saves recomputing what they check.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from collections.abc import Callable
from dataclasses import fields, replace
from importlib.metadata import distributions
from pathlib import Path
from typing import Any

from prefect.cache_policies import CacheKeyFnPolicy
from prefect.states import State

from quantgate.catalog.models import ModelSpec
from quantgate.catalog.paths import CATALOG_DIR
from quantgate.catalog.records import CalibrationSamples, ModelArtifact, VariantArtifact
from quantgate.catalog.sources import GgufSource, HubSource, LocalSource, ShapeSource
from quantgate.catalog.suites import SuiteSpec
from quantgate.catalog.variants import CalibrationSpec, VariantSpec
from quantgate.tasks.runtime.files import write_atomic
from quantgate.tasks.steps import calibration, download, quantize
from quantgate.tasks.steps.calibration import CalibrationError, load_calibration

CACHE_DIR = "cache"
KEY_MEMO = "build-keys"
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def record_identity(cls: type) -> str:
    """Where a cached result's class lives and what fields it has: results are pickled, so a record that moved
    or changed shape must miss the cache (and be made anew) rather than hit a result that cannot be read."""
    return f"{cls.__module__}.{cls.__qualname__}({','.join(f.name for f in fields(cls))})"


def download_key(spec: ModelSpec, cache_dir: Path) -> str | None:
    """Cache key of a download, or None (not cached) where the checkpoint is not known before fetching:
    a hub branch or tag may move, so only a pinned commit is cached."""
    src = spec.source
    if isinstance(src, HubSource):
        if not _COMMIT.match(src.revision):
            return None
        ident: dict[str, Any] = {"hub": src.repo_id, "sha": src.revision}
    elif isinstance(src, LocalSource):
        folder = Path(src.path).expanduser().resolve()
        if not (folder / "config.json").is_file():
            return None  # the step itself reports what is wrong with the folder
        ident = {"local": str(folder), "sha": download.folder_sha256(folder, cache_dir)}
    elif isinstance(src, GgufSource):
        try:
            sha = download.gguf_sha(spec.id, src, cache_dir)
        except download.DownloadError:
            return None
        ident = {"gguf": sha, "libs": {k: v for k, v in quantize.lib_versions().items() if k == "transformers"}}
    elif isinstance(src, ShapeSource):
        try:
            sha = download.shape_sha(spec.id, src)
        except download.DownloadError:
            return None
        # transformers writes the tokenizer and lays out the tensors.
        ident = {"shape": sha, "libs": {k: v for k, v in quantize.lib_versions().items() if k == "transformers"}}
    else:
        return None
    return f"download-{_digest({'model': spec.id, 'record': record_identity(ModelArtifact), **ident})[:32]}"


def quantize_key(model: ModelArtifact, spec: VariantSpec, calib: CalibrationSpec) -> str:
    """Cache key of a build: the variant uid (model sha + recipe hash + library versions [+ calibration])."""
    if spec.load_time:
        uid = quantize.load_time_uid(model, spec)
    else:
        # As the build makes its uid: the family's kept modules in the recipe, no calibration read for a refusal.
        spec, refused = quantize.for_family(model, spec)
        _, recipe_hash = quantize.recipe_for(spec)
        calibration = None
        if spec.needs_calibration and refused is None:
            calibration = load_calibration(calib, model.path).fingerprint
        uid = quantize.variant_uid(model, recipe_hash, quantize.lib_versions(), calibration)
    # The name is part of the key: the artifact carries it, and two names may share one recipe.
    return f"quantize-{uid}-{_digest([spec.name, model.uid, record_identity(VariantArtifact)])[:8]}"


def calibration_check_key(calib: CalibrationSpec, model: ModelArtifact, evaluated: calibration.Evaluated) -> str | None:
    """Cache key of a calibration check, or None (not cached) where the set's documents cannot be read (the check
    itself says why). It is what the verdict depends on: the set's spec and its documents as read; the tokenizer
    that makes its samples and decodes them (the checkpoint's content sha); the text it is compared with
    (`evaluated`, as `calibration.evaluated_documents` reads it: each document's strings); and the code that
    does it (`environment`)."""
    try:
        documents = calibration.calibration_documents(calib)
    except CalibrationError:
        return None
    ident = {
        "calibration": calib.model_dump(mode="json"),
        "documents": _digest(documents),
        "tokenizer": {"model": model.model_id, "sha": model.sha},
        "evaluated": _digest([[name, [calibration.strings(d) for d in docs]] for name, docs in evaluated]),
        "environment": environment(),
        "record": record_identity(CalibrationSamples),
    }
    return f"calibration-{_digest(ident)[:32]}"


@functools.cache
def environment() -> str:
    """sha256 over the installed packages (names and versions) and quantgate's own code (tasks/ and catalog/):
    a key derived with libraries and code is made anew when either changes."""
    packages = sorted({(d.metadata["Name"] or "", d.version) for d in distributions()})
    digest = hashlib.sha256(json.dumps(packages).encode())
    for folder in (Path(__file__).parents[1], CATALOG_DIR):
        for f in sorted(folder.rglob("*.py")):
            digest.update(f"{f.relative_to(folder.parent).as_posix()}\0".encode() + f.read_bytes())
    return digest.hexdigest()


def _download_key_fn(context: Any, parameters: dict[str, Any]) -> str | None:
    return download_key(parameters["spec"], Path(parameters["cache_dir"]))


def remembered_quantize_key(model: ModelArtifact, spec: VariantSpec, calib: CalibrationSpec, root: Path,
                            serving: str | None = None) -> str:
    """quantize_key, kept under `root`/cache/build-keys by what it is computed from: the checkpoint, the variant
    spec, for a calibrated method the set's spec and documents as read, and `environment`. Computing it builds
    the recipe with llm-compressor and tokenizes the calibration set (seconds of imports, on a rerun that builds
    nothing); the same inputs find it here. `serving` (the engine the run evaluates with) is in the key: a build
    that vLLM cannot load is refused only where vLLM serves it, so a build made for another engine is no hit."""
    ident: dict[str, Any] = {"model": model.uid, "sha": model.sha, "variant": spec.model_dump(mode="json"),
                             "environment": environment()}
    if not spec.load_time and spec.needs_calibration:
        ident["calibration"] = {"spec": calib.model_dump(mode="json"),
                                "documents": _digest(calibration.calibration_documents(calib))}
    memo = Path(root) / CACHE_DIR / KEY_MEMO / _digest(ident)[:32]
    try:
        key = memo.read_text()
    except OSError:
        key = ""
    if not key.startswith("quantize-"):
        key = quantize_key(model, spec, calib)
        write_atomic(memo, key)  # whole or not at all, whichever build of the work dir writes it
    return f"{key}-{serving}" if serving else key


def _options(root: Path, key_fn: Callable[[Any, dict[str, Any]], str | None]) -> dict[str, Any]:
    cache = Path(root) / CACHE_DIR
    return {
        "cache_policy": CacheKeyFnPolicy(cache_key_fn=key_fn).configure(key_storage=cache / "keys"),
        "persist_result": True,
        "result_storage": cache / "results",
    }


def _run(task: Any, args: tuple, trusted: Callable[[Any], bool], tags: list[str], name: str) -> tuple[Any, bool]:
    """Run `task`; on a cache hit whose result is no longer trusted, run it again with a fresh record."""
    task = task.with_options(tags={*task.tags, *tags}, task_run_name=name)
    state: State = task(*args, return_state=True)
    result = state.result()
    if state.name == "Cached" and not trusted(result):
        state = task.with_options(refresh_cache=True)(*args, return_state=True)
        result = state.result()
    return result, state.name == "Cached"


def download_cached(spec: ModelSpec, root: Path) -> ModelArtifact:
    """download_task with its result cached under `root`/cache (models land in `root`/models)."""
    task = download.download_task.with_options(**_options(root, _download_key_fn))
    model, _ = _run(task, (spec, root / "models"), lambda m: (Path(m.path) / "config.json").is_file(),
                    [f"model:{spec.id}"], f"download {spec.id}")
    return model


def check_calibration_cached(calib: CalibrationSpec, model: ModelArtifact, suite: SuiteSpec,
                             root: Path) -> CalibrationSamples:
    """check_calibration_task with its pass cached under `root`/cache: a rerun with the same inputs (see
    `calibration_check_key`) is a cache hit and checks nothing again; an overlapping set raises CalibrationError
    (one line) on every run."""
    evaluated = calibration.evaluated_documents(suite)  # read once: for the key, and for the check on a miss
    key = calibration_check_key(calib, model, evaluated)
    task = calibration.check_calibration_task.with_options(**_options(root, lambda context, parameters: key))
    samples, _ = _run(task, (calib, model.path, suite, evaluated), lambda _: True, [f"model:{model.model_id}"],
                      f"check calibration {model.model_id}")
    return samples


def build_cached(
    model: ModelArtifact, spec: VariantSpec, calib: CalibrationSpec, root: Path,
    existing: Callable[[str], dict | None] | None = None, serving: str | None = None,
) -> VariantArtifact:
    """build_variant_task with its result cached under `root`/cache; a cache hit is a reuse."""
    task = quantize.build_variant_task.with_options(
        **_options(root, lambda context, parameters: remembered_quantize_key(model, spec, calib, root, serving)))

    def trusted(v: VariantArtifact) -> bool:
        return v.ok and v.path is not None and (Path(v.path) / quantize.MARKER).is_file()

    # The variant is in the run's name, not in a tag: Prefect asks its server for the limits of each new set of
    # tags (up to seconds on the temporary server), and remembers only for a few seconds that a set has none.
    variant, hit = _run(task, (model, spec, calib, root / "variants", existing, serving), trusted,
                        [f"model:{model.model_id}"], f"quantize {model.model_id}/{spec.name}")
    return replace(variant, reused=True) if hit else variant
