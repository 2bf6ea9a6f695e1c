"""watch-releases: evaluate new hub releases of the authors/families the catalog watches.

The catalog's `watch:` entries name an author (and a search string for a family). The watcher lists
their newest models on the hub (huggingface_hub `HfApi.list_models`, with each model's commit sha),
drops every (model id, sha) the warehouse has seen (evaluated, or triggered before) and starts one
`evaluate-model` run per new release. `released=["org/name@sha", ...]` skips the listing: a hub
webhook relay or a person says what was just released. Listing happens before anything is started,
so a hub that cannot be reached fails the run in one line and triggers nothing.

`listing_file` reads the listing from a JSON file of hub API model entries (what `/api/models`
returns and `HfApi.list_models` parses), for replaying a recorded listing.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, tags
from prefect.artifacts import create_table_artifact
from prefect.runtime import flow_run
from prefect.states import Failed, State

from quantgate.catalog.deployment import WatchSpec
from quantgate.catalog.errors import CatalogError, QuantgateError
from quantgate.catalog.load import Catalog, load_catalog
from quantgate.catalog.paths import DEFAULT_CATALOG
from quantgate.flows import dispatch
from quantgate.warehouse import ledger, sessions

EXPAND = ["sha", "author", "lastModified", "createdAt"]

Lister = Callable[[WatchSpec], Iterable[Any]]


class HubListingError(QuantgateError, RuntimeError):
    """The hub listing cannot be had; one line."""


@dataclass(frozen=True)
class Release:
    model_id: str
    sha: str
    template: str
    variants: tuple[str, ...] | None
    source: str  # hub | direct
    last_modified: str | None = None


def hub_lister(w: WatchSpec) -> Iterable[Any]:
    """The author's newest models on the hub, as HfApi.list_models gives them (ModelInfo)."""
    from huggingface_hub import HfApi

    return list(HfApi().list_models(author=w.author, search=w.search, sort="last_modified", limit=w.limit,
                                    expand=EXPAND))


def file_lister(path: str | Path) -> Lister:
    """A lister over a saved hub listing: a JSON list of /api/models entries, filtered as the hub filters."""
    from huggingface_hub import ModelInfo

    try:
        entries = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise HubListingError(f"listing file {path}: cannot read ({e})") from None
    if not isinstance(entries, list):
        raise HubListingError(f"listing file {path}: expected a JSON list of hub model entries")

    def lister(w: WatchSpec) -> list[Any]:
        found = [ModelInfo(**dict(e)) for e in entries
                 if e.get("id", "").split("/")[0] == w.author
                 and (not w.search or w.search.lower() in e["id"].lower())]
        found.sort(key=lambda m: m.last_modified.isoformat() if m.last_modified else "", reverse=True)
        return found[: w.limit]

    return lister


def _listing_error(w: WatchSpec, e: BaseException) -> HubListingError:
    from huggingface_hub.errors import OfflineModeIsEnabled

    who = w.author + (f" ({w.search})" if w.search else "")
    chain = [e]
    while chain[-1].__cause__ is not None or chain[-1].__context__ is not None:
        chain.append(chain[-1].__cause__ or chain[-1].__context__)
    if any(isinstance(c, OfflineModeIsEnabled) for c in chain):
        why = "offline mode is on (HF_HUB_OFFLINE=1)"
    else:
        text = " ".join(str(e).split())[:200]
        why = f"hub unreachable ({type(e).__name__}: {text})" if text else f"hub unreachable ({type(e).__name__})"
    return HubListingError(f"cannot list the hub models of {who}: {why}; nothing triggered")


def from_listing(cat: Catalog, lister: Lister) -> list[Release]:
    """Every listed model of every watch entry, with its sha; raises HubListingError before any is returned."""
    out: list[Release] = []
    for w in cat.watch:
        try:
            infos = list(lister(w))
        except HubListingError:
            raise
        except Exception as e:  # noqa: BLE001 - whatever the hub client raised becomes one line
            raise _listing_error(w, e) from None
        for info in infos:
            if not getattr(info, "sha", None):
                continue  # a listing without shas cannot be compared; the hub returns them with expand=sha
            modified = getattr(info, "last_modified", None)
            out.append(Release(info.id, info.sha, w.template, w.variants, "hub",
                               modified.isoformat() if modified else None))
    return out


def from_released(cat: Catalog, released: list[str], template: str | None) -> list[Release]:
    """Releases named directly: 'org/name@sha' (or 'org/name', resolved to its newest commit on the hub)."""
    out = []
    for ref in released:
        repo, _, sha = ref.strip().partition("@")
        if repo.count("/") != 1 or repo.startswith("/") or repo.endswith("/"):
            raise CatalogError(f"released model {ref!r}: expected 'org/name@commit-sha'")
        if not sha:
            sha = _resolve(repo)
        w = next((w for w in cat.watch if w.author == repo.split("/")[0]
                  and (not w.search or w.search.lower() in repo.lower())), None)
        chosen = template or (w.template if w else cat.models[0].id)
        cat.model(chosen)  # an unknown template fails here
        out.append(Release(repo, sha, chosen, w.variants if w and not template else None, "direct"))
    return out


def _resolve(repo: str) -> str:
    from huggingface_hub import HfApi

    try:
        return HfApi().model_info(repo).sha
    except Exception as e:  # noqa: BLE001
        raise _listing_error(WatchSpec(author=repo.split("/")[0], search=repo.split("/")[1], template="-"), e) from None


def _name() -> str:
    p = flow_run.parameters
    if p.get("released"):
        return f"watch-releases: {', '.join(p['released'])}"
    return "watch-releases: hub listing" + (f" from {Path(p['listing_file']).name}" if p.get("listing_file") else "")


@flow(name="watch-releases", flow_run_name=_name)
def watch_releases(
    catalog: str | None = None,
    warehouse: str | None = None,
    workdir: str | None = None,
    released: list[str] | None = None,
    template: str | None = None,
    listing_file: str | None = None,
    evaluate_deployment: str | None = None,
) -> list[dict[str, Any]] | State:
    """Start evaluate-model for every new release of the watched authors (or for `released`)."""
    log = get_run_logger()
    cat = load_catalog(Path(catalog) if catalog else DEFAULT_CATALOG)
    try:
        if released:
            releases = from_released(cat, released, template)
        else:
            releases = from_listing(cat, file_lister(listing_file) if listing_file else hub_lister)
    except (HubListingError, CatalogError) as e:
        return Failed(message=str(e))
    unique = list({(r.model_id, r.sha): r for r in releases}.values())
    wh = warehouse or sessions.default_path()
    with sessions.session(wh) as con:
        seen = ledger.seen_releases(con, [(r.model_id, r.sha) for r in unique])
    rows: list[dict[str, Any]] = []
    for r in unique:
        row = {**asdict(r), "variants": list(r.variants) if r.variants else None}
        if (r.model_id, r.sha) in seen:
            rows.append({**row, "action": "seen", "flow_run_id": None})
            continue
        rid = _trigger(r, catalog, warehouse, workdir, evaluate_deployment)
        with sessions.session(wh) as con:
            ledger.record_trigger(con, r.model_id, r.sha, r.source, rid)
        log.info("%s@%s: new release, evaluate-model run %s", r.model_id, r.sha[:12], rid)
        rows.append({**row, "action": "triggered", "flow_run_id": rid})
    log.info("%d release(s) listed, %d new", len(rows), sum(r["action"] == "triggered" for r in rows))
    if rows:
        create_table_artifact([{k: r[k] for k in ("model_id", "sha", "source", "action", "flow_run_id")} for r in rows],
                              key="release-watch", description="releases the watcher saw and what it started")
    return rows


def _trigger(r: Release, catalog: str | None, warehouse: str | None, workdir: str | None,
             deployment: str | None) -> str:
    params: dict[str, Any] = {"model": r.model_id, "revision": r.sha, "template": r.template}
    if r.variants:
        params["variants"] = list(r.variants)
    for key, value in (("catalog", catalog), ("warehouse", warehouse), ("workdir", workdir)):
        if value is not None:
            params[key] = value
    run_tags = ["quantgate", "release", f"model:{r.model_id}"]
    if deployment:
        return dispatch.submit(deployment, params, name=f"evaluate {r.model_id}@{r.sha[:12]} (new release)",
                               tags=run_tags, idempotency_key=f"release:{r.model_id}@{r.sha}")
    from quantgate.flows.evaluate_model import evaluate_model

    with tags(*run_tags):
        state = evaluate_model(**params, return_state=True)
    return str(state.state_details.flow_run_id)
