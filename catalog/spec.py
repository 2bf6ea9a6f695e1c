"""What every catalog spec shares: strict frozen models, a union chosen by its `kind`, content hashes, and a
validation error as one line naming the file and the key."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Discriminator, ValidationError


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


def validation_line(path: Path, err: ValidationError) -> str:
    """The first validation error of a file as one line: the file, the key, what is wrong (and how many more)."""
    first = err.errors()[0]
    loc = ".".join(str(p) for p in first["loc"]) or "(top level)"
    msg = first["msg"].removeprefix("Value error, ")
    more = f" (+{err.error_count() - 1} more)" if err.error_count() > 1 else ""
    return f"{path}: {loc}: {msg}{more}"
