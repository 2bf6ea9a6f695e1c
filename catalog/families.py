"""What a model family needs from a build (`families.yaml` beside this module), found by the `model_type` of the
model's config.json: modules every build keeps in 16 bits whatever the variant says, and the methods or schemes
the family is refused with (everywhere, or where vLLM evaluates it), each with its one-line reason."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import get_args

from pydantic import Field, ValidationError, field_validator, model_validator

from quantgate.catalog.errors import CatalogError
from quantgate.catalog.paths import CATALOG_DIR
from quantgate.catalog.spec import Strict, read_mapping, validation_line
from quantgate.catalog.variants import Method, VariantSpec

FAMILIES_FILE = CATALOG_DIR / "families.yaml"
# What `refuse` may name: a method, or a scheme of any method.
_REFUSABLE = (*get_args(Method), *get_args(VariantSpec.model_fields["scheme"].annotation))
# A scheme key with this suffix names its channel-wise variants only (no group size), e.g. `W8A16/channel`.
CHANNEL_WISE = "/channel"


class Family(Strict):
    # The file's key, filled in on load; refusals name the family by it.
    name: str
    model_types: tuple[str, ...] = Field(min_length=1)
    keep: tuple[str, ...] = ()
    refuse: dict[str, str] = Field(default_factory=dict)
    # What vLLM cannot load of this family: refused only where the run evaluates with vLLM.
    refuse_on_vllm: dict[str, str] = Field(default_factory=dict)

    @field_validator("refuse", "refuse_on_vllm")
    @classmethod
    def _known(cls, refuse: dict[str, str]) -> dict[str, str]:
        if unknown := sorted(set(refuse) - set(_REFUSABLE) - {f"{s}{CHANNEL_WISE}" for s in _REFUSABLE}):
            raise ValueError(f"refuse names {unknown}: neither a method nor a scheme ({', '.join(_REFUSABLE)}),"
                             f" nor a scheme with {CHANNEL_WISE!r} (no group size)")
        if multi := [k for k, why in refuse.items() if "\n" in why.strip()]:
            raise ValueError(f"refuse {multi[0]}: the reason must be one line")
        return refuse

    def refusal(self, spec: VariantSpec, serving: str | None = None) -> str | None:
        """Why `spec` cannot be built for this family (one line), or None; with `serving` "vllm", also what vLLM
        cannot load. A channel-wise scheme's reason comes first, then the scheme's, then the method's."""
        keys = ([f"{spec.scheme}{CHANNEL_WISE}"] if spec.group_size is None else []) + [spec.scheme, spec.method]
        for where, refused in (("", self.refuse), (" on vLLM", self.refuse_on_vllm if serving == "vllm" else {})):
            if why := next((refused[k] for k in keys if k in refused), None):
                return f"refused for {self.name}{where} ({spec.method} {spec.scheme}): {why.strip()}"
        return None

    def apply(self, spec: VariantSpec) -> VariantSpec:
        """`spec` with this family's kept modules added to its `ignore`; the very spec when it has them all, so
        the recipe, and the uid of a build, of a family that needs nothing more stay what they were."""
        extra = tuple(p for p in self.keep if p not in spec.ignore)
        return spec.model_copy(update={"ignore": (*spec.ignore, *extra)}) if extra else spec


class _FamiliesFile(Strict):
    families: dict[str, Family]

    @model_validator(mode="before")
    @classmethod
    def _named(cls, data: object) -> object:
        if isinstance(data, dict) and isinstance(data.get("families"), dict):
            named = {k: {**v, "name": k} if isinstance(v, dict) else v for k, v in data["families"].items()}
            data = {**data, "families": named}
        return data

    @model_validator(mode="after")
    def _one_family_per_type(self) -> _FamiliesFile:
        seen: dict[str, str] = {}
        for family in self.families.values():
            for model_type in family.model_types:
                if model_type in seen:
                    raise ValueError(f"model_type {model_type!r} is in both {seen[model_type]} and {family.name}")
                seen[model_type] = family.name
        return self


@functools.cache
def families() -> dict[str, Family]:
    """Every family of families.yaml by name (read once per process)."""
    raw = read_mapping(FAMILIES_FILE, "families", "families")
    try:
        return dict(_FamiliesFile.model_validate(raw).families)
    except ValidationError as e:
        raise CatalogError(validation_line(FAMILIES_FILE, e)) from None


def family_of(config: dict) -> Family | None:
    """The family of a model's config (its config.json as a mapping), or None for a family not in the file."""
    model_type = config.get("model_type")
    return next((f for f in families().values() if model_type in f.model_types), None)


def model_family(model_dir: str | Path) -> Family | None:
    """The family of the checkpoint folder `model_dir`, by its config.json; None without one."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None  # the build itself says what is wrong with the folder
    return family_of(config) if isinstance(config, dict) else None
