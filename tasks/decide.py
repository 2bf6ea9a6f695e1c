"""Accept or reject a variant: a pure function of warehouse rows and the policy."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prefect import task

from quantgate.catalog.schema import Policy
from quantgate.tasks.records import Decision


def _fmt(x: float) -> str:
    return f"{x:.4g}"


def _quality_checks(policy: Policy, recovery: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    checks = []
    for gate in policy.quality:
        rows = [r for r in recovery if r["task"] == gate.task and r["metric"] == gate.metric]
        rows.sort(key=lambda r: r["filter"] != "none")
        name = f"{gate.task}/{gate.metric}"
        if not rows or rows[0]["recovery"] is None:
            checks.append({"check": name, "passed": False, "note": f"{name} not measured"})
            continue
        r = rows[0]
        ok = r["recovery"] >= gate.min_recovery
        checks.append({
            "check": name, "passed": ok, "value": r["recovery"], "threshold": gate.min_recovery,
            "variant_value": r["variant_value"], "base_value": r["base_value"],
            "note": f"{name} recovery {_fmt(r['recovery'])} {'>=' if ok else '<'} {gate.min_recovery}"
                    f" (variant {_fmt(r['variant_value'])} vs base {_fmt(r['base_value'])})",
        })
    return checks


def _speed_check(policy: Policy, speed: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    gate = policy.speed
    if gate is None:
        return None
    name = f"speed {gate.engine}/{gate.scenario}"
    rows = [r for r in speed if r["engine"] == gate.engine and r["scenario"] == gate.scenario]
    if not rows or rows[0]["status"] != "ok" or rows[0]["speedup"] is None:
        why = rows[0]["reason"] if rows and rows[0]["reason"] else "no base measurement" if rows else "not run"
        # Not measured is not evidence either way: the decision says so and rests on quality and size.
        return {"check": name, "passed": None, "note": f"{name} not measured ({why})"}
    s = rows[0]["speedup"]
    ok = s >= gate.min_speedup
    return {"check": name, "passed": ok, "value": s, "threshold": gate.min_speedup,
            "note": f"{name} speedup {s:.2f}x {'>=' if ok else '<'} {gate.min_speedup}x"}


def _size_check(policy: Policy, size_bytes: int | None, base_size_bytes: int | None) -> dict[str, Any]:
    if not size_bytes or not base_size_bytes:
        return {"check": "size", "passed": False, "note": "size on disk unknown"}
    ratio = size_bytes / base_size_bytes
    ok = ratio <= policy.max_size_ratio
    return {"check": "size", "passed": ok, "value": ratio, "threshold": policy.max_size_ratio,
            "note": f"size {ratio:.2f}x base {'<=' if ok else '>'} {policy.max_size_ratio}x"}


def decide(
    variant: dict[str, Any],
    base_size_bytes: int | None,
    recovery: Sequence[dict[str, Any]],
    speed: Sequence[dict[str, Any]],
    policy: Policy,
) -> Decision:
    """`variant` is a row of `variants`; `recovery` and `speed` are its rows of the views of the same names."""
    uid = variant["variant_uid"]
    if variant["status"] != "built":
        return Decision(uid, "reject", f"reject: build failed: {variant['error']}",
                        [{"check": "build", "passed": False, "note": variant["error"]}],
                        policy.hash, None, None, None)
    checks = _quality_checks(policy, recovery)
    speed_check = _speed_check(policy, speed)
    if speed_check:
        checks.append(speed_check)
    checks.append(_size_check(policy, variant.get("size_bytes"), base_size_bytes))

    failed = [c for c in checks if c["passed"] is False]
    verdict = "reject" if failed else "accept"
    ordered = failed + [c for c in checks if c["passed"] is not False]
    reason = f"{verdict}: " + "; ".join(c["note"] for c in ordered)
    recoveries = [c["value"] for c in checks if c["check"] not in ("size", "build") and not c["check"].startswith("speed")
                  and "value" in c]
    return Decision(
        variant_uid=uid, decision=verdict, reason=reason, checks=checks, policy_hash=policy.hash,
        quality_recovery=min(recoveries) if recoveries else None,
        speedup=speed_check.get("value") if speed_check else None,
        size_ratio=next((c.get("value") for c in checks if c["check"] == "size"), None),
    )


decide_task = task(decide, name="decide")
