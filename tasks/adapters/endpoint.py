"""The endpoint engine: any OpenAI-compatible server benchmarked by URL (vllm serve, SGLang, Ollama,
TensorRT-LLM's server, transformers serve, a hosted API) with the serving client, scenarios and metrics
of the built-in vLLM serving scenario (tasks/adapters/speed/serving.py).

The server is not started here; what it is gets asked (`probe`): GET /version (vLLM, SGLang),
/api/version (Ollama), /info (TGI), /v1/models (owned_by), plus the `server` response header and the
stream's `model` / `system_fingerprint`. An API key is read from the environment variable the caller
names, sent as a Bearer token, and scrubbed from anything returned; it is never stored.
"""

from __future__ import annotations

import json
import random
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quantgate.catalog.deployment import EndpointSpec
from quantgate.catalog.records import RequestRecord, ServingLoad, Slo, SpeedResult
from quantgate.catalog.scenarios import ScenarioSpec, ServingScenario
from quantgate.catalog.settings import secret
from quantgate.tasks.adapters.speed.errors import ServingError
from quantgate.tasks.adapters.speed.metrics import summarize
from quantgate.tasks.adapters.speed.serving import run_loads

ENGINE = "endpoint"
# Paths that say what a server is, in the order asked, and where its name / version sit in the answer.
_PROBES = ("/version", "/api/version", "/info", "/v1/models")
# Seeded prompt words when there is no tokenizer: plain English, roughly one token each for most tokenizers.
_WORDS = ("the", "a", "little", "cat", "dog", "sun", "tree", "house", "day", "went", "saw", "happy", "big",
          "red", "girl", "boy", "park", "ball", "friend", "play", "run", "jump", "and", "then", "was", "very")
# A serving load as ServingScenario.load_sizes gives it: (label, max_concurrency, request_rate, number of prompts).
LoadSize = tuple[str, int | None, float | None, int]


@dataclass(frozen=True)
class Target:
    """Where and how to reach the server; `api_key_env` is the name of a variable, never the key."""

    url: str
    model: str
    api_key_env: str | None = None
    prompt_format: str = "text"
    tokenizer: str | None = None
    vllm_extras: bool = False
    device: str | None = None
    num_devices: int = 1

    @classmethod
    def from_spec(cls, spec: EndpointSpec) -> Target:
        return cls(**spec.model_dump(exclude={"scenarios"}))

    @property
    def base_url(self) -> str:
        """The URL without user info, query or fragment, and without a trailing /v1: what is stored."""
        parts = urllib.parse.urlsplit(self.url)
        host = parts.hostname or ""
        if parts.port:
            host = f"{host}:{parts.port}"
        path = parts.path.rstrip("/").removesuffix("/v1")
        return urllib.parse.urlunsplit((parts.scheme, host, path, "", ""))

    def api_key(self) -> str | None:
        if not self.api_key_env:
            return None
        key = secret(self.api_key_env)
        if not key:
            raise ServingError(f"environment variable {self.api_key_env} (the API key) is not set or empty")
        return key

    def headers(self) -> dict[str, str]:
        key = self.api_key()
        return {"Authorization": f"Bearer {key}"} if key else {}


def scrub(obj: Any, secret: str | None) -> Any:
    """`obj` with every occurrence of `secret` replaced, through strings, lists and dicts."""
    if not secret:
        return obj
    if isinstance(obj, str):
        return obj.replace(secret, "***")
    if isinstance(obj, dict):
        return {scrub(k, secret): scrub(v, secret) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [scrub(v, secret) for v in obj]
    return obj


def probe(target: Target, timeout_s: float = 5.0) -> dict[str, Any]:
    """What the server says about itself. Never raises: an unanswered path is recorded with its status."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({})) if _loopback(target.base_url) else (
        urllib.request.build_opener())
    answers: dict[str, Any] = {}
    headers: dict[str, str] = {}
    for path in _PROBES:
        request = urllib.request.Request(target.base_url + path, headers=target.headers())
        try:
            with opener.open(request, timeout=timeout_s) as r:
                body = r.read(64 * 1024)
                headers = headers or {k.lower(): v for k, v in r.headers.items() if k.lower() in ("server", "x-powered-by")}
                try:
                    answers[path] = {"status": r.status, "json": json.loads(body)}
                except ValueError:
                    answers[path] = {"status": r.status, "text": body[:200].decode(errors="replace")}
        except urllib.error.HTTPError as e:
            headers = headers or {k.lower(): v for k, v in e.headers.items() if k.lower() in ("server", "x-powered-by")}
            answers[path] = {"status": e.code}
        except (urllib.error.URLError, OSError) as e:
            answers[path] = {"error": f"{type(e).__name__}: {getattr(e, 'reason', e)}"}
    identity: dict[str, Any] = {"probes": _trim(answers), "headers": headers}
    identity["server"], identity["server_version"] = _name_and_version(answers, headers)
    return scrub(identity, target.api_key())


def _name_and_version(answers: dict[str, Any], headers: dict[str, str]) -> tuple[str | None, str | None]:
    def js(path: str) -> Any:
        a = answers.get(path) or {}
        return a.get("json") if a.get("status") == 200 else None

    version = name = None
    if isinstance(v := js("/api/version"), dict) and v.get("version"):
        name, version = "ollama", str(v["version"])
    elif isinstance(v := js("/version"), dict) and v.get("version"):
        version = str(v["version"])
    elif isinstance(v := js("/info"), dict) and v.get("version"):
        name, version = "text-generation-inference", str(v["version"])
    models = js("/v1/models")
    if isinstance(models, dict) and models.get("data"):
        owner = models["data"][0].get("owned_by")
        name = name or (str(owner) if owner else None)
    name = name or headers.get("server")
    return name, version


def _trim(answers: dict[str, Any]) -> dict[str, Any]:
    """Answers small enough to store: a model list keeps ids and owners, other JSON its scalar fields."""
    out = {}
    for path, a in answers.items():
        a = dict(a)
        j = a.get("json")
        if isinstance(j, dict) and isinstance(j.get("data"), list):
            a["json"] = {"data": [{k: m.get(k) for k in ("id", "owned_by", "root", "max_model_len") if k in m}
                                  for m in j["data"][:20] if isinstance(m, dict)]}
        elif isinstance(j, dict):
            a["json"] = {k: v for k, v in j.items() if isinstance(v, (str, int, float, bool)) or v is None}
        out[path] = a
    return out


def _loopback(url: str) -> bool:
    return (urllib.parse.urlsplit(url).hostname or "") in ("127.0.0.1", "localhost", "::1")


def endpoint_prompts(target: Target, scenario: ScenarioSpec, n: int) -> list[list[int]] | list[str]:
    """n prompts for the server. With a tokenizer: the scenario's prompts (same ids as every engine
    gets), as ids or decoded to text. Without: seeded words, about input_len of them (text only)."""
    if target.tokenizer:
        from transformers import AutoTokenizer

        from quantgate.tasks.adapters.speed.prompts import make_prompts

        ids = make_prompts(scenario.model_copy(update={"num_prompts": n}), target.tokenizer)
        if target.prompt_format == "tokens":
            return ids
        tok = AutoTokenizer.from_pretrained(target.tokenizer)
        return [tok.decode(p, skip_special_tokens=True) for p in ids]
    if target.prompt_format == "tokens":
        raise ServingError("prompt_format 'tokens' needs a tokenizer folder to draw token ids from")
    rng = random.Random(scenario.seed)
    prefix = [rng.choice(_WORDS) for _ in range(scenario.shared_prefix_len)]
    return [" ".join(prefix + [rng.choice(_WORDS) for _ in range(scenario.input_len - len(prefix))]) for _ in range(n)]


def bench_endpoint(
    target: Target, scenario_name: str, scenario: ScenarioSpec, *, timeout_s: float = 900.0
) -> tuple[SpeedResult, list[ServingLoad]]:
    """Drive the server through the serving scenario's loads. Returns the summed result (as
    serve_scenario's: tokens_per_s is the best load's), with the server's identity in details["endpoint"] once its
    loads ran, and the loads. Never raises for server trouble: the result says failed."""
    config = _endpoint_config(target, scenario)
    secret = None

    def result(status: str, reason: str | None, **measured: Any) -> SpeedResult:
        return SpeedResult(ENGINE, scenario_name, status, scrub(reason, secret), config, **measured)  # type: ignore[arg-type]

    if not isinstance(scenario, ServingScenario):
        return result("failed", f"scenario {scenario_name!r} is {scenario.kind}; an endpoint runs serving scenarios"), []
    try:
        secret = target.api_key()
        headers = target.headers()
        identity = probe(target)
        sizes = scenario.load_sizes()
        loads = _run_scenario_loads(target, scenario, sizes, headers, timeout_s)
    except Exception as e:  # noqa: BLE001 - one failed row, the caller goes on
        return result("failed", f"{type(e).__name__}: {e}"), []
    identity, seen = _scrubbed_identity(identity, loads, secret)
    slo = Slo(**scenario.slo.model_dump()) if scenario.slo else None
    summaries = [{"load": load.label, **summarize(load.records, load.duration_s, slo)} for load in loads]
    ok = [r for load in loads for r in load.records if r.success]
    if not loads:
        return result("failed", "the time was up before the first load", details={"endpoint": identity}), loads
    if not ok:
        first_error = next((r.error for load in loads for r in load.records if r.error), None)
        return result("failed", f"no request succeeded: {first_error}", repetitions=summaries,
                      details={"endpoint": identity}), loads
    return result("ok", None, **_measured(target, loads, ok, summaries, identity, seen, sizes)), loads


def _endpoint_config(target: Target, scenario: ScenarioSpec) -> dict[str, Any]:
    """The scenario and how the server was reached, as the result's config (the key's variable, never the key)."""
    return {**scenario.model_dump(mode="json"),
            "endpoint": {"base_url": target.base_url, "model": target.model, "api_key_env": target.api_key_env,
                         "prompt_format": target.prompt_format, "vllm_extras": target.vllm_extras,
                         "tokenizer": target.tokenizer, "num_devices": target.num_devices}}


def _run_scenario_loads(target: Target, scenario: ServingScenario, sizes: list[LoadSize], headers: dict[str, str],
                        timeout_s: float) -> list[ServingLoad]:
    prompts = endpoint_prompts(target, scenario, max(n for *_, n in sizes))
    deadline = time.monotonic() + timeout_s
    return run_loads(target.base_url, target.model, scenario, sizes, prompts, None, deadline,
                     headers=headers, vllm_extras=target.vllm_extras)


def _scrubbed_identity(identity: dict[str, Any], loads: list[ServingLoad],
                       secret: str | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """The server's identity with what its streams said of it, and those streams' own; the API key scrubbed
    from both and from every request's error."""
    for load in loads:
        for r in load.records:
            r.error = scrub(r.error, secret)
    seen = next((load.server_info for load in loads if load.server_info), {})
    identity = scrub({**identity, "stream": seen}, secret)
    identity["server"] = identity.get("server") or seen.get("header.server")
    return identity, seen


def _measured(target: Target, loads: list[ServingLoad], ok: list[RequestRecord], summaries: list[dict[str, Any]],
              identity: dict[str, Any], seen: dict[str, Any], sizes: list[LoadSize]) -> dict[str, Any]:
    """The figures of a run with successful requests `ok`: the best load's rates and medians, the totals."""
    best = max(summaries, key=lambda s: s["output_tokens_per_s"])
    versions = {k: v for k, v in (("server", identity.get("server")), ("server_version", identity.get("server_version")),
                                   ("model", seen.get("model")), ("system_fingerprint", seen.get("system_fingerprint")))
                if v}
    details: dict[str, Any] = {"best_load": best["load"], "endpoint": identity}
    if len(loads) < len(sizes):
        details["loads_not_run"] = [label for label, *_ in sizes[len(loads):]]
    return {
        "device": target.device,
        "num_requests": sum(len(load.records) for load in loads),
        "input_tokens": sum(r.prompt_len for r in ok),
        "output_tokens": sum(r.output_tokens for r in ok),
        "tokens_per_s": best["output_tokens_per_s"],
        "total_tokens_per_s": best["total_tokens_per_s"],
        "requests_per_s": best["requests_per_s"],
        "ttft_ms": best["ttft_ms_p50"],
        "tpot_ms": best["tpot_ms_p50"],
        "e2el_ms": best["e2el_ms_p50"],
        "repetitions": summaries,
        "versions": versions,
        "details": details,
    }


def measure_endpoint(target: Target, engine: str, scenarios: Sequence[tuple[str, ScenarioSpec]], *, work_dir: Path,
                     timeout_s: float | None, pair_with: str | None,
                     on_point: Callable[[SpeedResult, list[ServingLoad]], None] | None,
                     ) -> list[tuple[SpeedResult, list[ServingLoad]]]:
    """The `endpoint` backend of tasks/steps/measure.py: each serving scenario driven against the server `target`
    reaches. Nothing is started, so nothing is written under `work_dir` and there is no base to pair with; the
    server's identity rides in each row's details["endpoint"]."""
    out = []
    for name, scenario in scenarios:
        result, loads = bench_endpoint(target, name, scenario, **({"timeout_s": timeout_s} if timeout_s else {}))
        if on_point:
            on_point(result, loads)
        out.append((result, loads))
    return out
