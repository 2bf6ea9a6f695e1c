"""What a command line selects from a catalog: a model by id, folder or hub id, a revision, variant tokens."""

from __future__ import annotations

from pathlib import Path
from typing import get_args

from pydantic import ValidationError

from quantgate.catalog.errors import CatalogError
from quantgate.catalog.load import Catalog
from quantgate.catalog.models import ModelSpec
from quantgate.catalog.scenarios import EngineName
from quantgate.catalog.sources import HubSource, LocalSource, ShapeSource, shape_config, shape_tokenizer_files

# `shape:NAME` (a published shape) or `shape:PATH` (a config.json, or a folder holding one): a model's shape with
# random weights. A colon is in no hub id and ends no catalog id, so the prefix cannot shadow either.
SHAPE_PREFIX = "shape:"


def adhoc_model(catalog: Catalog, ref: str, variants: list[str] | None = None, template: str | None = None,
                scenarios: list[str] | None = None, engines: list[str] | None = None,
                tokenizer: str | None = None) -> ModelSpec:
    """A model named on the command line: a catalog id, a local folder, a hub id (org/name[@revision]) or a
    model's shape with random weights (shape:NAME or shape:path/to/config.json), whose id is shape/NAME.

    `variants` and `scenarios` replace the catalog's lists for this run; `engines` is only checked here
    (the flow keeps each scenario's engines that it names). `template` is the catalog model whose variants,
    suite, calibration, scenarios and policy a model outside the catalog gets (default: the catalog's first);
    `tokenizer` is a shape's tokenizer folder (ShapeSource.tokenizer)."""
    if tokenizer is not None and not ref.startswith(SHAPE_PREFIX):
        raise CatalogError(f"a tokenizer folder is for a model's shape (shape:NAME), not for {ref!r},"
                           " which has a tokenizer of its own")
    for name in scenarios or ():
        if name not in catalog.scenarios:
            raise CatalogError(f"unknown scenario {name!r}: the catalog defines {sorted(catalog.scenarios)}")
    for engine in engines or ():
        if engine not in get_args(EngineName):
            raise CatalogError(f"unknown engine {engine!r}: known engines are {list(get_args(EngineName))}")
    override = {"scenarios": tuple(scenarios)} if scenarios else {}
    for m in catalog.models:
        if m.id == ref:
            return m.model_copy(update={**override, **({"variants": tuple(variants)} if variants else {})})
    base = catalog.model(template) if template else catalog.models[0]
    if Path(ref).expanduser().exists():
        path = Path(ref).expanduser().resolve()
        source: HubSource | LocalSource | ShapeSource = LocalSource(path=str(path))
        model_id = path.name
    elif ref.startswith(SHAPE_PREFIX):
        source = _shape_source(ref.removeprefix(SHAPE_PREFIX), tokenizer)
        model_id = f"shape/{source.name}"
    elif ref.count("/") == 1 and not ref.startswith((".", "/")):
        repo, _, rev = ref.partition("@")
        source = HubSource(repo_id=repo, revision=rev or "main")
        model_id = repo
    else:
        raise CatalogError(
            f"unknown model {ref!r}: not a catalog id ({[m.id for m in catalog.models]}), an existing folder, or a hub id"
            " 'org/name' (or a model's shape 'shape:NAME')"
        )
    chosen = tuple(variants) if variants else base.variants
    for v in chosen:
        if v not in catalog.variants:
            raise CatalogError(f"unknown variant {v!r}: the catalog defines {sorted(catalog.variants)}")
    # The template's published figures are another model's.
    return base.model_copy(update={"id": model_id, "source": source, "variants": chosen, "published": (), **override})


def _shape_source(what: str, tokenizer: str | None) -> ShapeSource:
    """A published shape's name, else a path to a config.json (or its folder), checked as a catalog's would be."""
    folder = str(Path(tokenizer).expanduser().resolve()) if tokenizer else None
    if Path(what).expanduser().exists():
        source = ShapeSource(config=str(Path(what).expanduser().resolve()), tokenizer=folder)
    else:
        try:
            source = ShapeSource(shape=what, tokenizer=folder)
        except ValidationError as e:
            why = e.errors()[0]["msg"].removeprefix("Value error, ")
            raise CatalogError(f"{SHAPE_PREFIX}{what}: {why} (or a path to a config.json)") from None
    shape_config(source)
    shape_tokenizer_files(source)
    return source


def with_revision(spec: ModelSpec, revision: str | None) -> ModelSpec:
    """`spec` pinned to a hub revision (a commit sha, branch or tag); None leaves it as it is."""
    if not revision:
        return spec
    if not isinstance(spec.source, HubSource):
        raise CatalogError(f"{spec.id}: revision {revision!r} given, but the model is a {spec.source.kind} source, not a hub one")
    return spec.model_copy(update={"source": spec.source.model_copy(update={"revision": revision})})


def resolve_variants(catalog: Catalog, model_ref: str, tokens: list[str]) -> list[str]:
    """Variant names from names or method shorthands (`awq`, `gptq`), preferring the model's own variants."""
    own = next((m.variants for m in catalog.models if m.id == model_ref), ())
    chosen: list[str] = []
    for token in (t.strip() for t in tokens if t.strip()):
        if token in catalog.variants:
            chosen.append(token)
            continue
        by_method = [n for n in own if catalog.variants[n].method == token] or [
            n for n, v in catalog.variants.items() if v.method == token
        ][:1]
        if not by_method:
            methods = sorted({v.method for v in catalog.variants.values()})
            raise CatalogError(f"unknown variant or method {token!r}: variants {sorted(catalog.variants)}, methods {methods}")
        chosen.extend(n for n in by_method if n not in chosen)
    return chosen
