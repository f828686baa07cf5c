"""kvmesh's P2P counters in vLLM's own ``/metrics`` (connector stats, vLLM's KV connector API).

Each connector process (scheduler, worker) reads its Rust node's counters, sends what grew since
the last engine step as ``KvmeshStats`` (vLLM aggregates the processes' stats and hands them to
its frontend), and ``KvmeshPromMetrics`` adds them to counters of the same names a kvmesh engine
exports (``kvmesh_p2p_pulls_total{outcome,reason}``, ...), labelled with vLLM's ``model_name``
and ``engine`` as well. The connector's own ``metrics_port`` keeps serving the full set.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kvmesh_vllm.settings import Settings

# Counter (without `_total`) -> its labels, as kvmesh-transfer registers them.
COUNTERS: dict[str, tuple[str, ...]] = {
    "kvmesh_p2p_pulls": ("outcome", "reason"),
    "kvmesh_p2p_blocks": ("direction",),
    "kvmesh_p2p_payload_bytes": ("direction",),
    "kvmesh_p2p_refused_connections": ("reason",),
    "kvmesh_p2p_protocol_errors": ("direction",),
    "kvmesh_p2p_fetches_served": (),
}
_SAMPLE = re.compile(r"^(kvmesh_p2p_\w+)_total(?:\{([^}]*)\})?\s+(\S+)$")
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def counter_samples(metrics_text: str) -> dict[str, float]:
    """The ``COUNTERS`` samples of a Prometheus text, keyed ``name|label value|...``."""
    out: dict[str, float] = {}
    for line in metrics_text.splitlines():
        m = _SAMPLE.match(line)
        if not m or m.group(1) not in COUNTERS:
            continue
        labels = dict(_LABEL.findall(m.group(2) or ""))
        key = "|".join([m.group(1), *(labels.get(n, "") for n in COUNTERS[m.group(1)])])
        out[key] = float(m.group(3))
    return out


class CounterDeltas:
    """What a node's counters grew by since the previous call."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}

    def take(self, metrics_text: str) -> dict[str, float]:
        now = counter_samples(metrics_text)
        grown = {k: v - self._last.get(k, 0.0) for k, v in now.items()}
        self._last = now
        return {k: d for k, d in grown.items() if d > 0}


@dataclass
class KvmeshStats(KVConnectorStats):
    """``data["counters"]``: counter key -> growth over the interval."""

    def __post_init__(self) -> None:
        self.data.setdefault("counters", {})

    def reset(self) -> None:
        self.data = {"counters": {}}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        mine = self.data.setdefault("counters", {})
        for k, v in (other.data or {}).get("counters", {}).items():
            mine[k] = mine.get(k, 0.0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        return {k.replace("|", ":"): v for k, v in self.data["counters"].items() if v}

    def is_empty(self) -> bool:
        return not any(self.data.get("counters", {}).values())


class KvmeshPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            name: self._counter_cls(
                name=name,
                documentation=f"kvmesh P2P: {name.removeprefix('kvmesh_p2p_').replace('_', ' ')}"
                              " (as a kvmesh engine exports it).",
                labelnames=[*labelnames, *extra],
            )
            for name, extra in COUNTERS.items()
        }
        # Which servers can use each other's blocks, for routers to group endpoints by (as a
        # kvmesh engine exports it). Computed from the same settings the connector starts with.
        fingerprint = self._gauge_cls(
            name="kvmesh_p2p_fingerprint_info",
            documentation="Id of the fingerprint a peer's KV must match to be used here; "
                          "endpoints with equal ids can exchange blocks.",
            multiprocess_mode="mostrecent",
            labelnames=[*labelnames, "fingerprint"],
        )
        fingerprint_id = Settings(vllm_config).fingerprint_id()
        for values in per_engine_labelvalues.values():
            fingerprint.labels(*values, fingerprint_id).set(1)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        engine = self.per_engine_labelvalues.get(engine_idx, [])
        for key, grown in (transfer_stats_data or {}).get("counters", {}).items():
            name, *values = key.split("|")
            counter = self._counters.get(name)
            if counter is not None and grown > 0 and len(values) == len(COUNTERS[name]):
                counter.labels(*engine, *values).inc(grown)
