"""Which checkpoint's speed is measured for which.

A checkpoint's speed key is what its speed rows depend on: its format (tasks/adapters/speed/checkpoint.speed_format: the
same config, quantization layout and tensor shapes run the same kernels on the same shapes), the scenarios and
engines, the libraries and the device. One checkpoint per key is measured (the first one ready: on one GPU its
engines can start while the others still build) and the rest of the key take its rows; a key measured by an
earlier run is not measured again unless asked.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Sequence

from quantgate.catalog.load import Catalog
from quantgate.catalog.models import ModelSpec
from quantgate.catalog.records import VariantArtifact
from quantgate.tasks.adapters.speed.checkpoint import speed_format
from quantgate.tasks.steps.benchmark import speed_environment


class SpeedPlan:
    """The speed keys of one model's checkpoints in one run, and the checkpoint that measures each."""

    def __init__(self, spec: ModelSpec, cat: Catalog, engines: Sequence[str] | None) -> None:
        self._scenarios = [(name, cat.scenarios[name]) for name in spec.scenarios]
        self._engines = list(engines) if engines else None
        self._common = {"scenarios": {n: s.model_dump(mode="json") for n, s in self._scenarios},
                        "engines": sorted(engines or []), "environment": speed_environment()}
        # Speculative decoding accepts drafts by what the weights predict: its speed is the checkpoint's own.
        self._by_format = not any(s.speculative for _, s in self._scenarios)
        self._keys: dict[str, str] = {}
        self._measures: dict[str, VariantArtifact] = {}
        self._lock = threading.Lock()

    def key(self, v: VariantArtifact) -> str:
        if v.uid not in self._keys:
            fmt = speed_format(v.path) if self._by_format and v.path else None
            identity = {**self._common, "format": fmt or f"checkpoint:{v.uid}", "base": v.method == "base"}
            self._keys[v.uid] = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
        return self._keys[v.uid]

    def claim(self, v: VariantArtifact) -> bool:
        """Whether `v` measures its key: the first checkpoint of the key to ask does."""
        with self._lock:
            return self._measures.setdefault(self.key(v), v).uid == v.uid

    def measurer(self, v: VariantArtifact, ready: Sequence[VariantArtifact]) -> VariantArtifact:
        """The checkpoint among `ready` that measures `v`'s key: the one that claimed it, else the first of the
        key in `ready` (the claimant failed after its build)."""
        claimed = self._measures.get(self.key(v))
        same = [c for c in ready if self.key(c) == self.key(v)]
        return claimed if claimed is not None and claimed in same else same[0]
