"""Random block contents that either side can regenerate from a seed, so a destination is
verified block by block without shipping a copy of the source pool.

Word j of block b of a pool filled from `seed` is `row(seed)[j] ^ key(seed, b)`: `row` is one
block of random words, `key` a random word per block. Every block differs from every other in
every word (a block landing in the wrong place, a shifted copy or a partial write all show), and
filling or checking a pool costs one XOR per word, so a 1 GiB pool is filled at memory speed.
"""

from __future__ import annotations

from typing import cast

import numpy as np
import numpy.typing as npt

U64 = npt.NDArray[np.uint64]

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
# Keys and rows of one seed come from disjoint counter streams.
_KEY_STREAM = np.uint64(0x5851F42D4C957F2D)


def _mix(x: U64) -> U64:
    """splitmix64's finalizer, element-wise (uint64 arithmetic wraps)."""
    with np.errstate(over="ignore"):
        x = x ^ (x >> np.uint64(30))
        x = x * _M1
        x = x ^ (x >> np.uint64(27))
        x = x * _M2
        return cast(U64, x ^ (x >> np.uint64(31)))


def _stream(seed: int, base: np.uint64, index: U64) -> U64:
    with np.errstate(over="ignore"):
        start = np.uint64(seed & 0xFFFFFFFFFFFFFFFF) * _GOLDEN + base
        return _mix(start + (index + np.uint64(1)) * _GOLDEN)


def row(seed: int, words: int) -> U64:
    """The random words every block of a `seed` pool is built from."""
    return _stream(seed, np.uint64(0), np.arange(words, dtype=np.uint64))


def keys(seed: int, blocks: npt.NDArray[np.int64]) -> U64:
    """One random word per block index."""
    return _stream(seed, _KEY_STREAM, blocks.astype(np.uint64))
