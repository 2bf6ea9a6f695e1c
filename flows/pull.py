"""pull-model: a model into the work dir, as evaluate-model's download stage fetches it (a hub snapshot at its
revision, a local folder's hash, a GGUF dequantized to 16 bits), so that later runs on the same work dir reuse it.
Nothing is written to the warehouse: the run that uses the model records it."""

from __future__ import annotations

from prefect import flow

from quantgate.catalog.load import load_catalog
from quantgate.catalog.paths import DEFAULT_CATALOG
from quantgate.catalog.records import ModelArtifact
from quantgate.catalog.selection import adhoc_model
from quantgate.flows.live import work_dir
from quantgate.tasks.steps.caching import download_cached


@flow(name="pull-model")
def pull_model(model: str, catalog: str | None = None, workdir: str | None = None,
               tokenizer: str | None = None) -> ModelArtifact:
    spec = adhoc_model(load_catalog(catalog or DEFAULT_CATALOG), model, tokenizer=tokenizer)
    return download_cached(spec, work_dir(workdir))
