"""Prefect task caching of download and quantize on the real tiny model (ephemeral API, real llm-compressor):
a second run is served from the cache records under the work dir, and a cached build whose checkpoint
was deleted is built again rather than trusted."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from prefect import flow

from quantgate.catalog.schema import LocalSource, ModelSpec, TextCalibration, VariantSpec
from quantgate.tasks import quantize
from quantgate.tasks.caching import CACHE_DIR, build_cached, download_cached, download_key, quantize_key

pytestmark = pytest.mark.slow

INT8 = VariantSpec(name="int8-w8a16", method="rtn", scheme="W8A16", group_size=None)


@flow
def fetch_and_build(model_path: str, root: str) -> tuple:
    from prefect.runtime import flow_run

    spec = ModelSpec(id="tiny", source=LocalSource(path=model_path), variants=("int8-w8a16",), suite="s")
    model = download_cached(spec, Path(root))
    variant = build_cached(model, INT8, TextCalibration(), Path(root))
    return str(flow_run.id), model, variant


def task_states(flow_run_id: str) -> dict[str, list[str]]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    out: dict[str, list[str]] = {}
    for r in sorted(runs, key=lambda r: r.expected_start_time or r.created):
        out.setdefault(r.name, []).append(r.state.name)
    return out


def test_second_run_is_served_from_the_cache_and_a_deleted_build_is_rebuilt(tiny_model, tmp_path):
    root = tmp_path / "work"
    run1, model, built = fetch_and_build(str(tiny_model), str(root))
    assert task_states(run1) == {"download tiny": ["Completed"], "quantize tiny/int8-w8a16": ["Completed"]}
    assert built.ok and not built.reused and (Path(built.path) / quantize.MARKER).is_file()
    # The cache key is the variant uid: model sha + recipe hash + quantizer library versions.
    _, recipe_hash = quantize.recipe_for(INT8)
    uid = quantize.variant_uid(model, recipe_hash, quantize.lib_versions())
    assert built.uid == uid and quantize_key(model, INT8, TextCalibration()).startswith(f"quantize-{uid}-")
    keys = sorted(p.name for p in (root / CACHE_DIR / "keys").iterdir())
    spec = ModelSpec(id="tiny", source=LocalSource(path=str(tiny_model)), variants=(), suite="s")
    assert keys == sorted([download_key(spec, root / "models"), quantize_key(model, INT8, TextCalibration())])

    run2, model2, again = fetch_and_build(str(tiny_model), str(root))
    assert task_states(run2) == {"download tiny": ["Cached"], "quantize tiny/int8-w8a16": ["Cached"]}
    assert model2 == model and again.reused and again.uid == built.uid and again.path == built.path

    shutil.rmtree(built.path)  # the cache record now names a checkpoint that is gone
    run3, _, rebuilt = fetch_and_build(str(tiny_model), str(root))
    # The stale hit is not trusted: the same task runs again with a refreshed cache record.
    assert task_states(run3) == {"download tiny": ["Cached"], "quantize tiny/int8-w8a16": ["Cached", "Completed"]}
    assert not rebuilt.reused and (Path(rebuilt.path) / quantize.MARKER).is_file()
    run4, _, cached = fetch_and_build(str(tiny_model), str(root))
    assert task_states(run4)["quantize tiny/int8-w8a16"] == ["Cached"] and cached.reused
