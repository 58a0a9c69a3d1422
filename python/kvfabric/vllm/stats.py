"""The connector's transfer statistics, in vLLM's connector-stats channel (worker → logger)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
except ImportError:  # driven without vLLM, as metadata.py says

    @dataclass
    class KVConnectorStats:  # type: ignore[no-redef]
        data: dict[str, Any] = field(default_factory=dict)


_COUNTS = ("loads", "load_failures", "acked", "lease_expired", "bytes")


@dataclass
class KVFabricStats(KVConnectorStats):
    """``loads``/``load_failures``: pulls done on the decode side; ``acked``/``lease_expired``:
    prefill holds ended by the decode's acknowledgement or by the lease; ``bytes`` pulled;
    ``load_ms``: each pull's duration."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = {k: 0 for k in _COUNTS}
        self.data["load_ms"] = []

    def record_load(self, nbytes: int, ms: float, ok: bool) -> None:
        self.data["loads" if ok else "load_failures"] += 1
        self.data["bytes"] += nbytes
        self.data["load_ms"].append(ms)

    def aggregate(self, other: KVConnectorStats) -> KVFabricStats:
        for k in _COUNTS:
            self.data[k] += other.data.get(k, 0)
        self.data["load_ms"].extend(other.data.get("load_ms", []))
        return self

    def reduce(self) -> dict[str, int | float]:
        ms = sorted(self.data["load_ms"])
        out: dict[str, int | float] = {k: self.data[k] for k in _COUNTS}
        if ms:
            out["load_ms_mean"] = round(sum(ms) / len(ms), 3)
            out["load_ms_p99"] = round(ms[min(len(ms) - 1, int(len(ms) * 0.99))], 3)
        return out

    def is_empty(self) -> bool:
        return not any(self.data[k] for k in _COUNTS)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVFabricStats:
        return cls(data=dict(data))
