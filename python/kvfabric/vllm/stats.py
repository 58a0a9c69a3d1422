"""The connector's statistics: through vLLM's connector-stats channel (workers and scheduler →
the stats logger's ``KV Transfer metrics`` line) and into vLLM's Prometheus registry
(``vllm:kvfabric_*``, :class:`KVFabricPromMetrics`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
    )
except ImportError:  # driven without vLLM, as metadata.py says

    @dataclass
    class KVConnectorStats:  # type: ignore[no-redef]
        data: dict[str, Any] = field(default_factory=dict)

    KVConnectorPromMetrics = object  # type: ignore[assignment,misc]


# Plain counts; then counts by reason.
_COUNTS = (
    "loads",
    "load_failures",
    "bytes",
    "acked",
    "lease_expired",
    "renewals",
    "local_hits",
    "ack_failures",
    "holds_refused",
)
_BY_REASON = ("failures", "not_pulled")


@dataclass
class KVFabricStats(KVConnectorStats):
    """Decode workers: ``loads`` / ``load_failures`` (and ``failures`` by reason), ``bytes``,
    ``load_ms`` per pull. Decode scheduler: ``not_pulled`` by reason (recomputed without
    trying), ``local_hits`` (nothing left to pull), ``renewals`` of holds it waits on,
    ``ack_failures``. Prefill scheduler: holds ``acked`` or ``lease_expired``,
    ``holds_refused`` (no slot)."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = {k: 0 for k in _COUNTS}
        self.data["load_ms"] = []
        for k in _BY_REASON:
            self.data[k] = {}

    def count(self, key: str, n: int = 1) -> None:
        self.data[key] += n

    def not_pulled(self, reason: str) -> None:
        self.data["not_pulled"][reason] = self.data["not_pulled"].get(reason, 0) + 1

    def record_load(self, nbytes: int, ms: float, reason: str) -> None:
        if reason:
            self.data["load_failures"] += 1
            self.data["failures"][reason] = self.data["failures"].get(reason, 0) + 1
        else:
            self.data["loads"] += 1
            self.data["bytes"] += nbytes
            self.data["load_ms"].append(ms)

    def aggregate(self, other: KVConnectorStats) -> KVFabricStats:
        for k in _COUNTS:
            self.data[k] += other.data.get(k, 0)
        self.data["load_ms"].extend(other.data.get("load_ms", []))
        for k in _BY_REASON:
            for reason, n in (other.data.get(k) or {}).items():
                self.data[k][reason] = self.data[k].get(reason, 0) + n
        return self

    def reduce(self) -> dict[str, int | float]:
        ms = sorted(self.data["load_ms"])
        out: dict[str, int | float] = {k: self.data[k] for k in _COUNTS}
        out["not_pulled"] = sum(self.data["not_pulled"].values())
        if ms:
            out["load_ms_mean"] = round(sum(ms) / len(ms), 3)
            out["load_ms_p99"] = round(ms[min(len(ms) - 1, int(len(ms) * 0.99))], 3)
        return out

    def is_empty(self) -> bool:
        return not any(self.data[k] for k in _COUNTS) and not any(self.data[k] for k in _BY_REASON)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVFabricStats:
        stats = cls()
        return stats.aggregate(cls(data=dict(data)))


# Pull durations, seconds: 1 ms to 10 s.
LOAD_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]


class KVFabricPromMetrics(KVConnectorPromMetrics):  # type: ignore[misc,valid-type]
    """``vllm:kvfabric_*`` in vLLM's /metrics, per engine (vLLM's ``model_name`` and
    ``engine`` labels, plus ``reason`` where there is one)."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        counter, histogram = self._counter_cls, self._histogram_cls
        self.labels = {i: [str(v) for v in vals] for i, vals in per_engine_labelvalues.items()}

        def c(name: str, doc: str, *extra: str) -> Any:
            return counter(name=f"vllm:kvfabric_{name}", documentation=doc,
                           labelnames=[*labelnames, *extra])  # fmt: skip

        self.pulls = c("pulls", "Requests whose KV a worker pulled (per worker).")
        self.failures = c(
            "pull_failures", "Pulls that failed, by reason; vLLM recomputed them.", "reason"
        )
        self.bytes = c("pulled_bytes", "Bytes of KV pulled.")
        self.not_pulled = c(
            "not_pulled",
            "Handed-over requests recomputed without a pull, by reason "
            "(invalid_params, layers, block_size, heads, layout, expired).",
            "reason",
        )
        self.local_hits = c("local_hits", "Handed-over requests the local prefix cache served.")
        self.holds = c("holds_ended", "Prefill holds ended, by how (acked, lease_expired).", "how")
        self.renewals = c("lease_renewals", "Lease renewals sent for holds waited on.")
        self.refused = c("holds_refused", "Prefill requests not handed over: no free slot.")
        self.seconds = histogram(
            name="vllm:kvfabric_pull_seconds",
            documentation="Time of one pull, from its start to the hold check after it.",
            buckets=LOAD_BUCKETS,
            labelnames=labelnames,
        )

    def observe(self, data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.labels.get(engine_idx, [])

        def inc(metric: Any, n: Any, *extra: str) -> None:
            if n:
                metric.labels(*labels, *extra).inc(n)

        inc(self.pulls, data.get("loads"))
        inc(self.bytes, data.get("bytes"))
        inc(self.local_hits, data.get("local_hits"))
        inc(self.renewals, data.get("renewals"))
        inc(self.refused, data.get("holds_refused"))
        inc(self.holds, data.get("acked"), "acked")
        inc(self.holds, data.get("lease_expired"), "lease_expired")
        for reason, n in (data.get("failures") or {}).items():
            inc(self.failures, n, reason)
        for reason, n in (data.get("not_pulled") or {}).items():
            inc(self.not_pulled, n, reason)
        hist = self.seconds.labels(*labels)
        for ms in data.get("load_ms") or ():
            hist.observe(ms / 1e3)
