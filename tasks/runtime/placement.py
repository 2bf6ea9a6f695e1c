"""Where a run of the model pool works: on the host of the worker that took it, with the devices it declares,
held through Prefect's global concurrency limits for as long as it runs.

A host's devices are limits of one slot each: `gpu:<host>:<id>` for every GPU its worker sees, or `cpu:<host>` on
a host without one (one model at a time: one job already keeps a CPU's cores busy). A run takes its model's limit
first, `model:<id>`, so the same model submitted twice runs one at a time and the second reuses what the first
stored; then the devices, so that nothing else that touches them (a build, an evaluation, KL, a measurement) runs
there meanwhile. The slots are leases that Prefect renews while this process lives: a host that dies gives them
back when its leases expire (QUANTGATE_LEASE_S), and Prefect's zombie automation crashes its run
(flows/deploy.py), whose next attempt resumes on any host.

Holding a model's limit also answers the warehouse's question of liveness: while one attempt holds it, no other
attempt of that model is at work anywhere.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

from quantgate.catalog.errors import QuantgateError
from quantgate.catalog.settings import host_name, reload, settings
from quantgate.tasks.runtime.telemetry import nvml_gpu_count

# How long a run waits between looks at its host's free GPUs when fewer than it needs are free.
POLL_S = 2.0


class PlacementError(QuantgateError, RuntimeError):
    """A run that cannot be placed on this host; one line."""


@dataclass(frozen=True)
class Placement:
    """What a run holds: its host, the GPU ids it owns there (none on a CPU host) and the limits it occupies."""

    host: str
    gpus: tuple[str, ...]
    limits: tuple[str, ...]

    @property
    def lanes(self) -> list[str | None]:
        """One lane per GPU held; one lane in this process's view for a single GPU or a CPU."""
        return list(self.gpus) if len(self.gpus) > 1 else [None]


def host_gpus() -> list[str]:
    """The GPUs this worker's host gives runs: CUDA_VISIBLE_DEVICES when set, else every GPU NVML finds."""
    shown = settings().cuda_visible_devices
    if shown is not None:
        return [g.strip() for g in shown.split(",") if g.strip() and g.strip() != "-1"]
    return [str(i) for i in range(nvml_gpu_count() or 0)]  # no driver, no NVML: a CPU host


def ensure_limit(name: str, limit: int = 1) -> None:
    """Create the global concurrency limit `name` unless it exists (two runs racing: one wins)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            client.read_global_concurrency_limit_by_name(name)
        except ObjectNotFound:
            try:
                client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=limit))
            except ObjectAlreadyExists:
                pass


def _free(names: list[str]) -> list[str]:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return [n for n in names if client.read_global_concurrency_limit_by_name(n).active_slots == 0]


@contextmanager
def placed(model_id: str, gpus: int = 1) -> Iterator[Placement]:
    """Hold `model_id`'s limit, then `gpus` of this host's GPUs (its CPU slot on a host without GPUs), for the
    body; this process and every process it starts see only the GPUs held."""
    from prefect.concurrency.sync import concurrency

    host = host_name()
    # A lease Prefect fails to renew once (a server restart) does not stop the run: it expires only if it stays so.
    hold = {"occupy": 1, "strict": True, "lease_duration": settings().lease_s, "raise_on_lease_renewal_failure": False}
    model_limit = f"model:{model_id}"
    ensure_limit(model_limit)
    with ExitStack() as held:
        held.enter_context(concurrency(model_limit, **hold))
        available = host_gpus()
        if not available:
            device_limits = [f"cpu:{host}"]
            ensure_limit(device_limits[0])
            held.enter_context(concurrency(device_limits, **hold))
            yield Placement(host, (), (model_limit, *device_limits))
            return
        if gpus > len(available):
            raise PlacementError(f"{model_id} needs {gpus} GPUs; host {host} has {len(available)}"
                                 f" ({','.join(available)})")
        names = {f"gpu:{host}:{g}": g for g in available}
        for name in names:
            ensure_limit(name)
        while True:
            free = _free(list(names))
            if len(free) >= gpus:
                try:  # every limit of the set at once, or none (the server decides): another run may take one first
                    held.enter_context(concurrency(free[:gpus], timeout_seconds=POLL_S, **hold))
                    break
                except TimeoutError:
                    continue
            time.sleep(POLL_S)
        ids = tuple(names[n] for n in free[:gpus])
        # The GPUs held become this process's view before anything touches CUDA; children inherit it.
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(ids)
        reload()
        yield Placement(host, ids, (model_limit, *free[:gpus]))
