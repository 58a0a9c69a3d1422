"""The work of one `kvfabric bench` row, reproduced: `inflight` slots each own a disjoint share of
destination blocks (slot k: blocks k, k + inflight, …); each batch of a slot takes `per_batch`
distinct destinations at random from its share and a source block at random from the whole pool
for each. A slot has one batch in flight at a time, so the last batch to name a destination block
is the one whose source it must hold."""

from __future__ import annotations

import dataclasses

import numpy as np
import numpy.typing as npt

from .errors import config

I64 = npt.NDArray[np.int64]


@dataclasses.dataclass(frozen=True)
class Shape:
    op: str  # "read" (pull into the initiator's pool) or "write" (push into the target's)
    pool_bytes: int
    block_size: int
    per_batch: int
    inflight: int
    seconds: float  # timed seconds in all, split over `runs`
    runs: int = 3

    @property
    def blocks(self) -> int:
        return self.pool_bytes // self.block_size

    @property
    def batch_bytes(self) -> int:
        return self.per_batch * self.block_size

    def validate(self) -> None:
        if self.op not in ("read", "write"):
            raise config("op", self.op, "is neither read nor write")
        for name, value in (
            ("block-size", self.block_size),
            ("blocks-per-batch", self.per_batch),
            ("inflight", self.inflight),
            ("runs", self.runs),
        ):
            if value <= 0:
                raise config(name, value, "must be positive")
        if not (self.seconds > 0 and np.isfinite(self.seconds)):
            raise config("seconds", self.seconds, "must be positive")
        if self.pool_bytes % self.block_size:
            raise config("pool-bytes", self.pool_bytes, f"is not a multiple of {self.block_size}")
        if self.blocks // self.inflight < self.per_batch:
            raise config(
                "pool-bytes",
                self.pool_bytes,
                f"holds {self.blocks} blocks: too few for {self.inflight} batches in "
                f"flight × {self.per_batch} distinct destinations",
            )
        if self.blocks >= 2**31:
            raise config("pool-bytes", self.pool_bytes, "holds 2^31 blocks or more")


@dataclasses.dataclass(frozen=True)
class Batch:
    slot: int
    local: I64  # block indices in the initiator's pool
    remote: I64  # … and in the target's, pairwise


class Slots:
    def __init__(self, shape: Shape, seed: int) -> None:
        self.shape = shape
        self.rng = np.random.default_rng(seed)
        self.shares = [
            np.arange(k, shape.blocks, shape.inflight, dtype=np.int64)
            for k in range(shape.inflight)
        ]
        # Destination block → the source block last written into it (-1: still poison).
        self.source_of = np.full(shape.blocks, -1, dtype=np.int64)

    def next(self, slot: int) -> Batch:
        dst = self.rng.choice(self.shares[slot], self.shape.per_batch, replace=False)
        src = self.rng.integers(0, self.shape.blocks, self.shape.per_batch, dtype=np.int64)
        self.source_of[dst] = src
        if self.shape.op == "read":
            return Batch(slot, local=dst, remote=src)
        return Batch(slot, local=src, remote=dst)
