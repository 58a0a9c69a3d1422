"""Where a layer's blocks lie in its KV cache tensor: the planes a block table is read over.

vLLM lays each layer's cache out as one tensor whose shape has a block dimension (its size is
the number of blocks, or a multiple when the attention kernel splits blocks): FlashAttention
``(2, blocks, block_size, heads, head)`` gives two planes (K, V); CPU attention
``(blocks, heads, block_size, 2 * head)`` and FlashInfer ``(blocks, 2, ...)`` give one. Every
dimension after the block dimension must be dense, so one block of one plane is one byte range.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product
from typing import Any

from ..errors import InvalidArgument


@dataclass(frozen=True)
class LayerLayout:
    """Planes of one layer as ``(base, stride, block_bytes)``, offsets from the tensor's start."""

    planes: tuple[tuple[int, int, int], ...]

    def block_table(self, region: int, offset: int = 0) -> list[tuple[int, int, int, int]]:
        """The planes as block-table planes of ``region``, where the tensor starts at
        ``offset``."""
        return [(region, offset + base, stride, size) for base, stride, size in self.planes]


def layer_layout(
    name: str, shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int, num_blocks: int
) -> LayerLayout:
    """The planes of a tensor holding ``num_blocks`` blocks (see the module docstring)."""
    for d, n in enumerate(shape):
        if n < num_blocks or n % num_blocks:
            continue
        split = n // num_blocks
        tail = 1
        dense = True
        for size, stride in reversed(list(zip(shape[d + 1 :], strides[d + 1 :], strict=True))):
            if size != 1 and stride != tail:
                dense = False
                break
            tail *= size
        if not dense or strides[d] != tail:
            continue
        block_bytes = split * tail * itemsize
        outer = [range(s) for s in shape[:d]]
        planes = tuple(
            (
                sum(i * st for i, st in zip(idx, strides[:d], strict=True)) * itemsize,
                block_bytes,
                block_bytes,
            )
            for idx in product(*outer)
        )
        return LayerLayout(planes)
    raise InvalidArgument(
        f"invalid kv cache {name}: shape {shape} strides {strides} has no dense dimension of "
        f"{num_blocks} blocks",
        name,
        str(shape),
    )


def tensor_layout(name: str, tensor: Any, num_blocks: int) -> LayerLayout:
    return layer_layout(
        name, tuple(tensor.shape), tuple(tensor.stride()), tensor.element_size(), num_blocks
    )
