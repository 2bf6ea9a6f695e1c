"""What an evaluation of a model depends on, hashed: the nightly re-evaluates a model when this changes.

The inputs are the checkpoint (commit sha or content hash), every variant's spec (with the calibration set it
names, if any), the suite, the scenarios, the model's calibration, the acceptance policy and the library versions
that build and score.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

from quantgate.catalog.errors import QuantgateError
from quantgate.catalog.load import Catalog
from quantgate.catalog.models import ModelSpec
from quantgate.catalog.sources import GgufSource, HubSource, LocalSource, ShapeSource
from quantgate.tasks.runtime.environment import library_versions
from quantgate.tasks.steps import download

INPUT_LIBS = ("quantgate", "llmcompressor", "compressed-tensors", "transformers", "lm_eval", "torch", "bitsandbytes")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


class ShaUnavailable(QuantgateError, RuntimeError):
    """The model's current checkpoint cannot be identified now (offline hub, missing folder); one line."""


def _versions() -> dict[str, str | None]:
    """INPUT_LIBS' versions, None for one not installed (its key stays, so that installing it changes the inputs)."""
    found = library_versions(INPUT_LIBS)
    return {name: found.get(name) for name in INPUT_LIBS}


def model_inputs(cat: Catalog, spec: ModelSpec, sha: str) -> tuple[str, dict[str, Any]]:
    """(sha256 of the inputs, the inputs) of evaluating `spec` at checkpoint `sha` with catalog `cat`."""
    policy = spec.policy or cat.policy
    inputs = {
        "model": spec.id,
        "sha": sha,
        "variants": {n: _variant_inputs(cat, spec, n) for n in spec.variants},
        "suite": cat.suites[spec.suite].model_dump(mode="json"),
        "scenarios": {n: cat.scenarios[n].model_dump(mode="json") for n in spec.scenarios},
        "calibration": spec.calibration.model_dump(mode="json"),
        "policy": policy.hash,
        "trust_remote_code": spec.trust_remote_code,
        "versions": _versions(),
    }
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest(), inputs


def _variant_inputs(cat: Catalog, spec: ModelSpec, name: str) -> dict[str, Any]:
    """A variant's spec, its own calibration set in full where it names one (a change of the set's content is a
    change of the variant). A variant without one dumps as it did before variants could name one: the model's
    calibration is an input of its own, and the catalog's other models keep their inputs' hash."""
    v = cat.variants[name]
    if v.calibration_set is None:
        return v.model_dump(mode="json", exclude={"calibration_set"})
    return {**v.model_dump(mode="json"), "calibration_set": cat.calibration_for(spec, v).model_dump(mode="json")}


def current_sha(spec: ModelSpec, work_root: Path, *, offline: bool | None = None) -> str:
    """The sha the model would be evaluated at now, without downloading or converting it."""
    src = spec.source
    cache_dir = Path(work_root) / "models"
    if isinstance(src, LocalSource):
        folder = Path(src.path).expanduser().resolve()
        if not (folder / "config.json").is_file():
            raise ShaUnavailable(f"{spec.id}: local model folder {folder} is missing or has no config.json")
        return download.folder_sha256(folder, cache_dir)
    if isinstance(src, GgufSource):
        try:
            return download.gguf_sha(spec.id, src, cache_dir)
        except download.DownloadError as e:
            raise ShaUnavailable(str(e)) from None
    if isinstance(src, ShapeSource):
        try:
            return download.shape_sha(spec.id, src)
        except download.DownloadError as e:
            raise ShaUnavailable(str(e)) from None
    assert isinstance(src, HubSource)
    if _COMMIT.match(src.revision):
        return src.revision
    offline = download._offline_from_env() if offline is None else offline
    if not offline:
        from huggingface_hub import HfApi

        try:
            return HfApi().model_info(src.repo_id, revision=src.revision).sha
        except Exception as e:  # noqa: BLE001 - an unreachable hub falls back to the local cache below
            reason = download.brief(e)
    else:
        reason = "offline mode is on"
    cached = download._cached(src, None)
    if cached is None:
        raise ShaUnavailable(f"{src.repo_id}@{src.revision}: cannot resolve the revision ({reason}) and it is not cached")
    return cached[1]
