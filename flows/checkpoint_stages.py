"""evaluate-model's stages that make its checkpoints: the model downloaded (its base checkpoint stored beside it; the
calibration sets its variants are built with checked against the suite first) and each variant built. Each is
reused where the run stored it before a crash, and from the work dir's cache (tasks/steps/caching.py) otherwise."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import get_run_logger

from quantgate.catalog.load import Catalog
from quantgate.catalog.models import ModelSpec
from quantgate.catalog.records import ModelArtifact, VariantArtifact
from quantgate.catalog.stages import Stage
from quantgate.catalog.variants import CalibrationSpec, VariantSpec
from quantgate.flows.stage_run import StageRun
from quantgate.tasks.steps.caching import build_cached, check_calibration_cached, download_cached
from quantgate.tasks.steps.quantize import base_variant, variant_from_row
from quantgate.warehouse import reads, writers


def download(run: StageRun, spec: ModelSpec, root: Path, cat: Catalog) -> ModelArtifact:
    """The model, fetched once its stored copy is gone (or was never stored); its model and base rows stored."""

    def stored(con: Any) -> ModelArtifact | None:
        model = reads.model_of(con, run.done.get((Stage.DOWNLOAD, "")) or "")
        return model if model is not None and (Path(model.path) / "config.json").is_file() else None  # gone: fetch again

    def write(con: Any, model: ModelArtifact, reused: bool) -> str:
        if not reused:
            writers.record_model(con, run.run_id, model)
            writers.record_variant(con, run.run_id, base_variant(model), role="base")
        return model.uid

    def fetch() -> ModelArtifact:
        model = download_cached(spec, root)
        # Before anything of the model is stored: calibration sharing text with what is evaluated is refused,
        # for every set a variant of it is built with (each set once; a pass is cached under the work dir).
        for calib in cat.calibration_sets(spec):
            check_calibration_cached(calib, model, cat.suites[spec.suite], root)
        return model

    return run.step(Stage.DOWNLOAD, "", stored=stored, compute=fetch, write=write, label=spec.id)


def build(run: StageRun, model: ModelArtifact, vspec: VariantSpec, calib: CalibrationSpec,
          root: Path, serving: str | None = None) -> VariantArtifact:
    """A variant built (or reused) with calibration set `calib`, its row stored; one that failed to build is
    returned failed (`ok` False), with its reason; `serving`: the engine the run evaluates with."""
    log = get_run_logger()

    def stored(con: Any) -> VariantArtifact | None:
        row = reads.run_variant(con, run.run_id, run.done.get((Stage.QUANTIZE, vspec.name)) or "")
        return variant_from_row(row, vspec) if row else None

    def make() -> VariantArtifact:
        variant = build_cached(model, vspec, calib, root, lambda uid: run.read(lambda c: reads.find_variant(c, uid)),
                               serving)
        log.info("%s: %s%s", vspec.name, "reused" if variant.reused else variant.status,
                 f" ({variant.error})" if variant.error else "")
        return variant

    def write(con: Any, variant: VariantArtifact, reused: bool) -> str:
        if not reused:
            writers.record_variant(con, run.run_id, variant, role="variant")
        return variant.uid

    return run.step(Stage.QUANTIZE, vspec.name, stored=stored, compute=make, write=write, label=vspec.name)
