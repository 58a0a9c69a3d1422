"""What the connector's scheduler side tells its workers each step, and what the workers tell
the scheduler once at start (vLLM's handshake metadata: their segments and layout)."""

from __future__ import annotations

from dataclasses import dataclass, field

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
    """One worker's segments: its KV cache and its acknowledgement mailbox, with their keys, and
    the block layout a peer must share to read it (plane sizes per layer)."""

    kv: str
    kv_key: int
    acks: str
    acks_key: int
    layout: tuple[tuple[int, ...], ...]


@dataclass
class Load:
    """Decode side: pull ``remote_block_ids`` of the prefill worker's segment into
    ``local_block_ids`` (empty: nothing to pull, only acknowledge), then write ``nonce`` into
    slot ``slot`` of its mailbox so it frees the blocks."""

    remote: list[dict]
    slot: int
    nonce: int
    local_block_ids: list[int]
    remote_block_ids: list[int]


@dataclass
class Hold:
    """Prefill side: keep the request's blocks until ``nonce`` shows up in mailbox slot
    ``slot`` or ``lease_s`` pass."""

    slot: int
    nonce: int
    lease_s: float


@dataclass
class KVFabricMetadata(KVConnectorMetadata):
    loads: dict[str, Load] = field(default_factory=dict)
    holds: dict[str, Hold] = field(default_factory=dict)
