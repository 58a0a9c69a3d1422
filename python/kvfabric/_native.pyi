"""Typed stubs of the Rust half of kvfabric (src/*.rs)."""

from collections.abc import Awaitable, Sequence
from typing import Any, Self

__version__: str

class HostBuffer:
    """Zeroed host memory (a sealed memfd the agent maps too); buffer protocol, writable."""

    def __init__(self, nbytes: int) -> None: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def address(self) -> int: ...
    def __len__(self) -> int: ...
    def __buffer__(self, flags: int, /) -> memoryview: ...
    @staticmethod
    def containing(ptr: int, nbytes: int) -> tuple[HostBuffer, int] | None: ...

class CudaRegion:
    device: int
    device_uuid: str
    ipc_handle: bytes
    offset: int
    len: int
    def __init__(
        self, ipc_handle: bytes, offset: int, len: int, device: int = 0, device_uuid: str = ""
    ) -> None: ...

class Region:
    index: int
    len: int
    location: str

class Segment:
    name: str
    key: int
    regions: list[Region]
    memory: list[Any]
    def __init__(self, name: str, key: int) -> None: ...

class Ops:
    def __len__(self) -> int: ...
    @property
    def nbytes(self) -> int: ...

class Transfer:
    bytes: int
    ops: int
    coalesced_ops: int
    transport: str
    transport_reason: str
    elapsed_us: int
    remote_agent: str

class Pulled:
    id: str
    bytes: int
    reason: str
    detail: str
    read_us: int
    check_us: int

class Pulls:
    def __init__(self, client: Client) -> None: ...
    def start(
        self,
        id: str,
        local: Segment,
        reads: Sequence[tuple[str, int, Ops]],
        timeout: float,
        check: tuple[str, int, Ops],
        check_timeout: float,
        scratch: HostBuffer,
        word: int,
        expect: int,
        traceparent: str | None = None,
        tracestate: str | None = None,
    ) -> None: ...
    def take(self) -> list[Pulled]: ...

class SegmentEvent:
    kind: str
    name: str
    agent: str
    regions: list[Region]

class Watch:
    def __iter__(self) -> Self: ...
    def __next__(self) -> SegmentEvent: ...
    def next(self, timeout: float | None = None) -> SegmentEvent | None: ...
    def __aiter__(self) -> Self: ...
    def __anext__(self) -> Awaitable[SegmentEvent]: ...
    def close(self) -> None: ...

def columns(
    local_regions: Any, local_offsets: Any, remote_regions: Any, remote_offsets: Any, lengths: Any
) -> Ops: ...
def block_table(
    local_planes: Sequence[tuple[int, int, int, int]],
    remote_planes: Sequence[tuple[int, int, int, int]],
    local_block_ids: Any,
    remote_block_ids: Any,
) -> Ops: ...

class Client:
    def __init__(self, socket_dir: str, timeout: float = 60.0) -> None: ...
    @property
    def socket_dir(self) -> str: ...
    def register(
        self,
        name: str,
        regions: Sequence[HostBuffer | CudaRegion],
        key: int | None = None,
        keep: Sequence[Any] | None = None,
    ) -> Segment: ...
    def deregister(self, segment: Segment) -> None: ...
    def submit(
        self,
        local: Segment,
        remote: str,
        remote_key: int,
        write: bool,
        ops: Ops,
        timeout: float | None = None,
        checksum: bool = False,
        traceparent: str | None = None,
        tracestate: str | None = None,
    ) -> Transfer: ...
    def submit_async(
        self,
        local: Segment,
        remote: str,
        remote_key: int,
        write: bool,
        ops: Ops,
        timeout: float | None = None,
        checksum: bool = False,
        traceparent: str | None = None,
        tracestate: str | None = None,
    ) -> Awaitable[Transfer]: ...
    def create_hold(
        self,
        segment: Segment,
        planes: Sequence[tuple[int, int, int, int]],
        block_ids: Any,
        ttl: float,
    ) -> int: ...
    def create_hold_async(
        self,
        segment: Segment,
        planes: Sequence[tuple[int, int, int, int]],
        block_ids: Any,
        ttl: float,
    ) -> Awaitable[int]: ...
    def extend_hold(self, segment: Segment, hold_key: int, ttl: float) -> float: ...
    def extend_hold_async(
        self, segment: Segment, hold_key: int, ttl: float
    ) -> Awaitable[float]: ...
    def end_hold(self, segment: Segment, hold_key: int, timeout: float | None = None) -> None: ...
    def end_hold_async(
        self, segment: Segment, hold_key: int, timeout: float | None = None
    ) -> Awaitable[None]: ...
    def status_json(self) -> str: ...
    def status_json_async(self) -> Awaitable[str]: ...
    def watch(self) -> Watch: ...
