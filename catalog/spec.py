"""What every catalog spec shares: strict frozen models, a union chosen by its `kind`, content hashes, a YAML
file's mapping read, and a validation error as one line naming the file and the key."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Discriminator, ValidationError

from quantgate.catalog.errors import CatalogError


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def kind_or(default: str) -> Discriminator:
    """A union's discriminator: the value's `kind`, or `default` for a mapping without one (blocks written
    before their kinds existed)."""

    def kind(value: object) -> str | None:
        if isinstance(value, dict):
            return value.get("kind", default)
        return getattr(value, "kind", None)

    return Discriminator(kind)


def content_hash(obj: object) -> str:
    """sha256 of a spec's JSON form, keys sorted: what identifies a policy, a catalog or a calibration set."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def read_mapping(path: Path, what: str, keys: str = "") -> dict:
    """The top-level mapping of the YAML file `path` (a `what` file: catalog, policy, GPU suite), or CatalogError in
    one line naming the file, and the line of a syntax error; `keys` says what the mapping should hold."""
    try:
        raw = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise CatalogError(f"{path}: no such {what} file") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}:" if mark else ""
        raise CatalogError(f"{path}:{where} not valid YAML ({getattr(e, 'problem', e)})") from None
    if not isinstance(raw, dict):
        raise CatalogError(f"{path}: (top level): expected a mapping{f' with keys {keys}' if keys else ''}")
    return raw


def validation_line(path: Path, err: ValidationError) -> str:
    """The first validation error of a file as one line: the file, the key, what is wrong (and how many more)."""
    first = err.errors()[0]
    loc = ".".join(str(p) for p in first["loc"]) or "(top level)"
    msg = first["msg"].removeprefix("Value error, ")
    more = f" (+{err.error_count() - 1} more)" if err.error_count() > 1 else ""
    return f"{path}: {loc}: {msg}{more}"
