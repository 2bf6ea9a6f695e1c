"""The catalog file: every section validated on load, relative paths resolved against the file's folder.

A bad file raises `CatalogError` with one line naming the file, the key and what is allowed."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, ValidationError, model_validator

from quantgate.catalog.deployment import EndpointSpec, WatchSpec
from quantgate.catalog.errors import CatalogError
from quantgate.catalog.models import ModelSpec
from quantgate.catalog.paths import DEFAULT_CATALOG, default_kl_text
from quantgate.catalog.policy import Policy
from quantgate.catalog.scenarios import ScenarioSpec
from quantgate.catalog.sources import GgufSource, LocalSource, ShapeSource, shape_config, shape_tokenizer_files
from quantgate.catalog.spec import Strict, content_hash, read_mapping, validation_line
from quantgate.catalog.suites import SuiteSpec
from quantgate.catalog.variants import CalibrationSpec, ChatCalibration, TextCalibration, VariantSpec


class Catalog(Strict):
    version: Literal[1]
    variants: dict[str, VariantSpec]
    suites: dict[str, SuiteSpec]
    scenarios: dict[str, ScenarioSpec] = {}
    models: tuple[ModelSpec, ...]
    policy: Policy
    # Authors/families on the hub whose new releases `watch-releases` evaluates.
    watch: tuple[WatchSpec, ...] = ()
    # OpenAI-compatible servers to benchmark by URL.
    endpoints: dict[str, EndpointSpec] = {}
    # US$ per hour of one device, by the device name the speed rows store (NVML's, e.g. "NVIDIA H200"),
    # and "cpu" for rows measured on the CPU. Each run stores the table it used (run_prices).
    gpu_prices: dict[str, Annotated[float, Field(gt=0)]] = {}
    # Named calibration sets that models refer to by name (`calibration: chat-holdout`).
    calibrations: dict[str, CalibrationSpec] = {}

    @model_validator(mode="before")
    @classmethod
    def _names_into_variants(cls, data: dict) -> dict:
        if isinstance(data, dict) and isinstance(data.get("variants"), dict):
            data = dict(data)
            data["variants"] = {
                k: ({"name": k, **v} if isinstance(v, dict) and "name" not in v else v) for k, v in data["variants"].items()
            }
        return data

    @model_validator(mode="before")
    @classmethod
    def _calibration_names(cls, data: dict) -> dict:
        if not isinstance(data, dict):
            return data
        named = data.get("calibrations") or {}
        if isinstance(named, dict):
            named = {k: ({**v, "name": k} if isinstance(v, dict) else v) for k, v in named.items()}
            data = {**data, "calibrations": named}
        if isinstance(data.get("models"), list):
            models = []
            for i, m in enumerate(data["models"]):
                if isinstance(m, dict) and isinstance(m.get("calibration"), str):
                    if m["calibration"] not in named:
                        raise ValueError(f"models.{i}.calibration: unknown calibration set {m['calibration']!r};"
                                         f" defined: {sorted(named)}")
                    m = {**m, "calibration": named[m["calibration"]]}
                models.append(m)
            data = {**data, "models": models}
        return data

    @model_validator(mode="after")
    def _references_resolve(self) -> Catalog:
        for name, v in self.variants.items():
            if v.calibration_set is not None and v.calibration_set not in self.calibrations:
                raise ValueError(f"variants.{name}.calibration_set: unknown calibration set {v.calibration_set!r};"
                                 f" defined: {sorted(self.calibrations)}")
        for i, m in enumerate(self.models):
            for v in m.variants:
                if v not in self.variants:
                    raise ValueError(f"models.{i}.variants: unknown variant {v!r}; defined: {sorted(self.variants)}")
            if m.suite not in self.suites:
                raise ValueError(f"models.{i}.suite: unknown suite {m.suite!r}; defined: {sorted(self.suites)}")
            for s in m.scenarios:
                if s not in self.scenarios:
                    raise ValueError(f"models.{i}.scenarios: unknown scenario {s!r}; defined: {sorted(self.scenarios)}")
            gated = [(g.task, g.metric) for g in (m.policy or self.policy).quality]
            seen: set[tuple[str, str]] = set()
            for j, f in enumerate(m.published):
                check = (f.task, f.metric)
                if check not in gated:
                    raise ValueError(f"models.{i}.published.{j}: {f.task}/{f.metric} is not a quality gate of the"
                                     f" model's policy; gated: {[f'{t}/{k}' for t, k in gated]}")
                if check in seen:
                    raise ValueError(f"models.{i}.published.{j}: a second figure for {f.task}/{f.metric}; one per check")
                seen.add(check)
        if self.policy.speed and self.policy.speed.scenario not in self.scenarios:
            raise ValueError(f"policy.speed.scenario: unknown scenario {self.policy.speed.scenario!r}")
        if (gate := self.policy.serving) and (gate.scenario not in self.scenarios
                                             or self.scenarios[gate.scenario].kind != "serving"):
            raise ValueError(f"policy.serving.scenario: {gate.scenario!r} is not a serving scenario of the catalog")
        for name, e in self.endpoints.items():
            for sc in e.scenarios:
                if sc not in self.scenarios:
                    raise ValueError(f"endpoints.{name}.scenarios: unknown scenario {sc!r}; defined: {sorted(self.scenarios)}")
                if self.scenarios[sc].kind != "serving":
                    raise ValueError(f"endpoints.{name}.scenarios: {sc!r} is {self.scenarios[sc].kind}, an endpoint runs serving scenarios")
        ids = [m.id for m in self.models]
        if len(ids) != len(set(ids)):
            raise ValueError(f"models: ids must be unique, got {ids}")
        for i, w in enumerate(self.watch):
            if w.template not in ids:
                raise ValueError(f"watch.{i}.template: unknown model {w.template!r}; the catalog has {ids}")
            for v in w.variants or ():
                if v not in self.variants:
                    raise ValueError(f"watch.{i}.variants: unknown variant {v!r}; defined: {sorted(self.variants)}")
        return self

    def model(self, model_id: str) -> ModelSpec:
        for m in self.models:
            if m.id == model_id:
                return m
        raise CatalogError(f"unknown model {model_id!r}: the catalog has {[m.id for m in self.models]}")

    def calibration_for(self, model: ModelSpec, variant: VariantSpec) -> CalibrationSpec:
        """The calibration set `variant` of `model` is built with: the variant's own `calibration_set`, else the
        model's calibration (which a variant that takes no calibration ignores)."""
        return self.calibrations[variant.calibration_set] if variant.calibration_set else model.calibration

    def calibration_sets(self, model: ModelSpec) -> list[CalibrationSpec]:
        """Every distinct calibration set the model's calibrated variants are built with, each once (two sets of
        the same content are one), in the order of the model's variants."""
        sets: dict[str, CalibrationSpec] = {}
        for name in model.variants:
            if self.variants[name].needs_calibration:
                calib = self.calibration_for(model, self.variants[name])
                sets.setdefault(content_hash(calib.model_dump(mode="json", exclude={"name"})), calib)
        return list(sets.values())

    @property
    def hash(self) -> str:
        return content_hash(self.model_dump(mode="json"))


def load_catalog(path: str | Path = DEFAULT_CATALOG) -> Catalog:
    """Load and validate a catalog. Relative paths inside it are resolved against the file's folder."""
    path = Path(path)
    raw = read_mapping(path, "catalog", "version, variants, suites, models, policy")
    if isinstance(raw.get("policy"), str):
        raw["policy"] = read_mapping(path.parent / raw["policy"], "policy")
    for m in raw.get("models") or []:
        if isinstance(m, dict) and isinstance(m.get("policy"), str):
            m["policy"] = read_mapping(path.parent / m["policy"], "policy")
    try:
        catalog = Catalog.model_validate(raw)
    except ValidationError as e:
        raise CatalogError(validation_line(path, e)) from None
    catalog = _resolve_paths(catalog, path.parent.resolve())
    for i, m in enumerate(catalog.models):
        if isinstance(m.source, ShapeSource):  # a config named by path is read once its path is resolved
            try:
                shape_config(m.source)
                shape_tokenizer_files(m.source)
            except CatalogError as e:
                raise CatalogError(f"{path}: models.{i}.source: {e}") from None
    return catalog


def _resolve_paths(catalog: Catalog, base: Path) -> Catalog:
    def resolve(p: str | None) -> str | None:
        return None if p is None else str((base / Path(p).expanduser()).resolve())

    def resolve_calibration(calib: CalibrationSpec) -> CalibrationSpec:
        if isinstance(calib, TextCalibration | ChatCalibration):
            return calib.model_copy(update={"path": resolve(calib.path)})
        return calib

    models = []
    for m in catalog.models:
        src = m.source
        if isinstance(src, LocalSource):
            src = src.model_copy(update={"path": resolve(src.path)})
        elif isinstance(src, GgufSource) and src.path:
            src = src.model_copy(update={"path": resolve(src.path)})
        elif isinstance(src, ShapeSource):
            src = src.model_copy(update={"config": resolve(src.config), "tokenizer": resolve(src.tokenizer)})
        models.append(m.model_copy(update={"source": src, "calibration": resolve_calibration(m.calibration)}))
    # The named sets too: variants are built with them by name (Catalog.calibration_for).
    calibrations = {name: resolve_calibration(c) for name, c in catalog.calibrations.items()}
    suites = {
        name: s.model_copy(
            update={"tasks": tuple(t.model_copy(update={"include_path": resolve(t.include_path)}) for t in s.tasks),
                    "kl_text": resolve(s.kl_text) or default_kl_text()}
        )
        for name, s in catalog.suites.items()
    }
    scenarios = {
        name: s.model_copy(update={"prompts_file": resolve(s.prompts_file)}) for name, s in catalog.scenarios.items()
    }
    endpoints = {name: e.model_copy(update={"tokenizer": resolve(e.tokenizer)}) for name, e in catalog.endpoints.items()}
    return catalog.model_copy(update={"models": tuple(models), "suites": suites, "scenarios": scenarios,
                                      "endpoints": endpoints, "calibrations": calibrations})
