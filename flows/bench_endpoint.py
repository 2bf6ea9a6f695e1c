"""bench-endpoint: benchmark an OpenAI-compatible server by URL with the serving scenarios of the catalog,
into the warehouse (engine "endpoint"; rows in speed_results, serving_loads, serving_requests, and the
server's identity in serving_endpoints).

The rows belong to a variant: one named after the endpoint's model (method "endpoint"), or an existing
variant (`variant_uid`) when the server serves a build quantgate made. The API key is read from the
environment variable named by `api_key_env` and never stored.

    python -m quantgate.flows.cli bench-endpoint http://127.0.0.1:8000 --model my-model --scenario endpoint-serving
"""

from __future__ import annotations

import dataclasses
import hashlib
import platform
import tempfile
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run

from quantgate.catalog.errors import CatalogError
from quantgate.catalog.load import Catalog, load_catalog
from quantgate.catalog.paths import DEFAULT_CATALOG
from quantgate.catalog.records import SpeedResult, VariantArtifact
from quantgate.catalog.scenarios import ScenarioSpec
from quantgate.tasks.adapters.endpoint import ENGINE, Target
from quantgate.tasks.runtime import environment
from quantgate.tasks.steps.measure import measure
from quantgate.warehouse import ledger, reads, sessions, writers

FLOW_NAME = "bench-endpoint"


def endpoint_variant(target: Target) -> VariantArtifact:
    """The variant an endpoint's rows belong to when no built variant is named: one per (URL, model)."""
    key = hashlib.sha256(f"{target.base_url}|{target.model}".encode()).hexdigest()[:12]
    return VariantArtifact(uid=f"endpoint:{target.model}@{key}", model_uid=f"endpoint:{target.model}",
                           name=target.model, method="endpoint", scheme=None, bits=None, group_size=None,
                           path=target.base_url, recipe=None, recipe_hash=None)


@task(name="bench-endpoint-scenario", cache_policy=NO_CACHE, task_run_name="{name}")
def _bench(target: Target, name: str, scenario: ScenarioSpec, timeout_s: float, wh: str, run_id: str,
           variant_uid: str) -> SpeedResult:
    with tempfile.TemporaryDirectory(prefix="quantgate-endpoint-") as work:
        ((result, loads),) = measure(target, ENGINE, [(name, scenario)], work_dir=work, timeout_s=timeout_s)
    with sessions.session(wh) as con:
        writers.record_measured(con, run_id, variant_uid, [(result, loads)])
        if identity := result.details.get("endpoint"):
            writers.record_endpoint(con, run_id, variant_uid, ENGINE, name, target.base_url, target.model, identity)
    return result


def _target(cat: Catalog, endpoint: str | None, url: str | None, model: str | None,
            overrides: dict[str, Any]) -> Target:
    """The server to benchmark: a catalog endpoint (at `url` when given) or a URL and model, with the `overrides`
    given (None: the catalog's)."""
    if endpoint is not None:
        if endpoint not in cat.endpoints:
            raise CatalogError(f"unknown endpoint {endpoint!r}: the catalog defines {sorted(cat.endpoints)}")
        target = Target.from_spec(cat.endpoints[endpoint])
    else:
        if not (url and model):
            raise CatalogError("give an endpoint name from the catalog, or a URL and --model")
        target = Target(url=url, model=model)
    target = dataclasses.replace(target, **{k: v for k, v in overrides.items() if v is not None})
    if url and endpoint is not None:
        target = dataclasses.replace(target, url=url)
    return target


def _serving_scenarios(cat: Catalog, scenarios: list[str] | None) -> list[str]:
    """The scenarios named, each a serving scenario of the catalog; CatalogError when none is or one is not."""
    serving = sorted(n for n, s in cat.scenarios.items() if s.kind == "serving")
    if not scenarios:
        raise CatalogError(f"no scenario given; serving scenarios of the catalog: {serving}")
    for name in scenarios:
        if name not in serving:
            raise CatalogError(f"unknown serving scenario {name!r}: the catalog's are {serving}")
    return scenarios


@flow(name=FLOW_NAME, log_prints=True)
def bench_endpoint_flow(
    url: str | None = None,
    model: str | None = None,
    scenarios: list[str] | None = None,
    endpoint: str | None = None,
    api_key_env: str | None = None,
    prompt_format: str | None = None,
    tokenizer: str | None = None,
    vllm_extras: bool | None = None,
    device: str | None = None,
    num_devices: int | None = None,
    variant_uid: str | None = None,
    catalog: str | None = None,
    warehouse: str | None = None,
    timeout_s: float = 900.0,
) -> list[dict]:
    """Benchmark a catalog endpoint (`endpoint`) or a URL + model; options given here override the catalog's."""
    log = get_run_logger()
    cat_path = catalog or str(DEFAULT_CATALOG)
    cat = load_catalog(cat_path)
    overrides = {"api_key_env": api_key_env, "prompt_format": prompt_format, "tokenizer": tokenizer,
                 "vllm_extras": vllm_extras, "device": device, "num_devices": num_devices}
    target = _target(cat, endpoint, url, model, overrides)
    if endpoint is not None:  # none named: the catalog endpoint's own
        scenarios = scenarios or list(cat.endpoints[endpoint].scenarios)
    scenarios = _serving_scenarios(cat, scenarios)
    target.api_key()  # a named but unset key variable fails here, before anything is written
    run_id = str(flow_run.id)
    wh = warehouse or str(sessions.default_path())
    variant = endpoint_variant(target)
    uid = variant_uid or variant.uid
    with sessions.session(wh) as con:
        ledger.start_run(con, run_id, FLOW_NAME, target.model, cat_path, cat.hash, platform.node(), environment.program())
        writers.record_prices(con, run_id, cat.gpu_prices, cat.hash)
        if variant_uid is None:
            writers.record_variant(con, run_id, variant, role="variant")
        else:
            writers.link_variant(con, run_id, uid, role="variant", reused=True)
    with ledger.run_outcome(wh, run_id):
        for name in scenarios:
            result = _bench(target, name, cat.scenarios[name], timeout_s, wh, run_id, uid)
            log.info("%s on %s: %s%s", name, target.base_url, result.status, f" ({result.reason})" if result.reason else "")
    with sessions.session(wh) as con:
        return reads.endpoint_scenarios(con, run_id)
