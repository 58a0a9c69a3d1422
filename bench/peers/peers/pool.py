"""A pool of KV blocks on the host (numpy) or on a GPU (torch), filled and checked in place."""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from . import pattern
from .errors import Kind, PeerError

# Rows handled per step when filling or checking: bounds the temporaries to a few MiB.
_STEP_BYTES = 32 << 20


@dataclasses.dataclass
class Verdict:
    blocks_checked: int
    mismatches: int
    first: str | None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class Pool(Protocol):
    addr: int
    nbytes: int
    block_size: int
    device: int | None

    @property
    def blocks(self) -> int: ...

    def fill(self, seed: int) -> None: ...

    def verify(
        self, source_of: npt.NDArray[np.int64], source_seed: int, poison_seed: int
    ) -> Verdict:
        """`source_of[d]` is the source block that destination block d must hold, or -1 where it
        must still hold its poison."""
        ...


def _check_shape(nbytes: int, block_size: int) -> None:
    if block_size <= 0 or block_size % 8:
        raise PeerError(Kind.CONFIG, "block-size", f"{block_size} is not a positive multiple of 8")
    if nbytes < block_size or nbytes % block_size:
        raise PeerError(
            Kind.CONFIG, "pool-bytes", f"{nbytes} is not a positive multiple of {block_size}"
        )


def _first_bad(d: int, s: int) -> str:
    what = "poison (never written)" if s < 0 else f"source block {s}"
    return f"destination block {d} should hold {what}"


class HostPool:
    def __init__(self, nbytes: int, block_size: int) -> None:
        _check_shape(nbytes, block_size)
        # Large numpy allocations are fresh anonymous mappings: page-aligned.
        self.array = np.empty(nbytes, dtype=np.uint8)
        self.addr = int(self.array.ctypes.data)
        self.nbytes = nbytes
        self.block_size = block_size
        self.device: int | None = None

    @property
    def blocks(self) -> int:
        return self.nbytes // self.block_size

    def _rows(self) -> npt.NDArray[np.uint64]:
        return self.array.view(np.uint64).reshape(self.blocks, self.block_size // 8)

    def fill(self, seed: int) -> None:
        rows = self._rows()
        base = pattern.row(seed, rows.shape[1])
        step = max(1, _STEP_BYTES // self.block_size)
        for lo in range(0, self.blocks, step):
            ids = np.arange(lo, min(lo + step, self.blocks), dtype=np.int64)
            np.bitwise_xor(
                base[None, :], pattern.keys(seed, ids)[:, None], out=rows[lo : lo + ids.size]
            )

    def verify(
        self, source_of: npt.NDArray[np.int64], source_seed: int, poison_seed: int
    ) -> Verdict:
        return _verify(self, source_of, source_seed, poison_seed)

    def wrong(
        self, at: npt.NDArray[np.int64], seed: int, ids: npt.NDArray[np.int64]
    ) -> npt.NDArray[np.intp]:
        """Positions i where block `at[i]` does not hold block `ids[i]` of a `seed` pool."""
        rows = self._rows()
        got = rows[at] ^ pattern.keys(seed, ids)[:, None]
        return np.nonzero((got != pattern.row(seed, rows.shape[1])[None, :]).any(axis=1))[0]


class CudaPool:
    """Device memory through torch (the GPU machine's own), filled and checked by torch kernels."""

    def __init__(self, nbytes: int, block_size: int, device: int) -> None:
        _check_shape(nbytes, block_size)
        import torch

        self._torch = torch
        self.tensor = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{device}")
        self.addr = int(self.tensor.data_ptr())
        self.nbytes = nbytes
        self.block_size = block_size
        self.device: int | None = device

    @property
    def blocks(self) -> int:
        return self.nbytes // self.block_size

    def _rows(self) -> Any:
        return self.tensor.view(self._torch.int64).view(self.blocks, self.block_size // 8)

    def _dev(self, a: npt.NDArray[np.uint64]) -> Any:
        return self._torch.from_numpy(a.view(np.int64)).to(self.tensor.device)

    def fill(self, seed: int) -> None:
        rows = self._rows()
        base = self._dev(pattern.row(seed, rows.shape[1]))
        step = max(1, (256 << 20) // self.block_size)
        for lo in range(0, self.blocks, step):
            ids = np.arange(lo, min(lo + step, self.blocks), dtype=np.int64)
            k = self._dev(pattern.keys(seed, ids))
            self._torch.bitwise_xor(base[None, :], k[:, None], out=rows[lo : lo + ids.size])
        self._torch.cuda.synchronize(self.tensor.device)

    def verify(
        self, source_of: npt.NDArray[np.int64], source_seed: int, poison_seed: int
    ) -> Verdict:
        return _verify(self, source_of, source_seed, poison_seed)

    def wrong(
        self, at: npt.NDArray[np.int64], seed: int, ids: npt.NDArray[np.int64]
    ) -> npt.NDArray[np.intp]:
        rows = self._rows()
        idx = self._torch.from_numpy(at).to(self.tensor.device)
        got = rows.index_select(0, idx) ^ self._dev(pattern.keys(seed, ids))[:, None]
        base = self._dev(pattern.row(seed, rows.shape[1]))
        bad = self._torch.nonzero((got != base[None, :]).any(dim=1)).flatten().cpu().numpy()
        return np.asarray(bad, dtype=np.intp)


def _verify(
    pool: HostPool | CudaPool, source_of: npt.NDArray[np.int64], source_seed: int, poison_seed: int
) -> Verdict:
    """Every block of `pool`: written ones against their source block, the rest against poison."""
    if source_of.shape != (pool.blocks,):
        raise PeerError(
            Kind.VERIFY, "source_of", f"{source_of.shape} blocks, pool has {pool.blocks}"
        )
    step = max(1, _STEP_BYTES // pool.block_size)
    bad = 0
    first: str | None = None
    for lo in range(0, pool.blocks, step):
        src = source_of[lo : lo + step]
        for written in (True, False):
            sel = np.nonzero(src >= 0 if written else src < 0)[0].astype(np.int64)
            if sel.size == 0:
                continue
            at = sel + lo
            wrong = (
                pool.wrong(at, source_seed, src[sel])
                if written
                else pool.wrong(at, poison_seed, at)
            )
            bad += int(wrong.size)
            if wrong.size and first is None:
                d = int(at[wrong[0]])
                first = _first_bad(d, int(source_of[d]))
    return Verdict(pool.blocks, bad, first)


def alloc(nbytes: int, block_size: int, device: int | None) -> HostPool | CudaPool:
    return HostPool(nbytes, block_size) if device is None else CudaPool(nbytes, block_size, device)
