"""What the connector's scheduler side tells its workers each step, and what the workers tell
the scheduler once at start (vLLM's handshake metadata)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .params import Handover
from .plan import GroupBlocks

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorHandshakeMetadata,
        KVConnectorMetadata,
    )
except ImportError:
    # The worker side can be driven without vLLM (its GPU test runs where vLLM is not
    # installed); the connector itself needs vLLM.
    KVConnectorHandshakeMetadata = KVConnectorMetadata = object  # type: ignore[assignment,misc]


@dataclass
class WorkerSegments(KVConnectorHandshakeMetadata):
    """One worker's KV cache segment, its key, and its layout (``WorkerLayout.wire()``)."""

    kv: str
    kv_key: int
    layout: list[Any]


@dataclass
class Load:
    """Decode side: pull the request's KV from the prefill workers of ``handover`` into the
    blocks of ``groups`` (one per KV cache group), then check the hold is still alive."""

    handover: Handover
    groups: tuple[GroupBlocks, ...]


@dataclass
class KVFabricMetadata(KVConnectorMetadata):
    """``loads`` to start; ``releases``: held prefill requests whose blocks vLLM may free now
    (every worker reports them as finished sending)."""

    loads: dict[str, Load] = field(default_factory=dict)
    releases: set[str] = field(default_factory=set)
