"""Where each layer's KV lies in a worker's KV cache: what a peer needs to read it, taken from the
tensors vLLM hands the connector, and its wire form in ``kv_transfer_params``.

vLLM (≥ 0.32) gives every attention layer a logical ``[B, H, N, C]`` view of its cache: kernel
blocks, the worker's KV heads, tokens per kernel block, and ``C`` elements per (head, row),
with strides set by the KV cache layout (``LBHNC`` is head-major inside a block, ``LBNHC``
token-major). What a row holds is the attention backend's business. GPU backends split ``C``
at the head size: row ``t`` is token ``t``'s K then V, one cell per (head, token), so a layer
can be read by a peer of another TP size (other heads), another block size or another layout:
the planner (``plan.py``) works on cells. vLLM's CPU attention packs each (block, head) for
its kernel (K transposed, every token's V after it): such a layer is *packed*, its (block,
head) ranges move whole, which allows another TP size but needs one block size on both
sides. A layer vLLM lays out any other way is *opaque*: its blocks are copied whole, which
needs the same block size and the same heads on both sides.

Nothing here imports vLLM: the worker side runs where vLLM is not installed (its GPU test).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from itertools import product
from typing import Any

from ..errors import InvalidArgument

# Bounds on what a peer's layout may describe (it arrives in untrusted request params).
MAX_LAYERS = 4096
MAX_WORKERS = 1024
MAX_BYTES = 1 << 48


def invalid(field: str, value: Any) -> InvalidArgument:
    """The error for a value of the request's ``kv_transfer_params`` (the field named, the
    value truncated)."""
    shown = repr(value)[:64]
    return InvalidArgument(f"kv_transfer_params.{field}: invalid value {shown}", field, shown)


@dataclass(frozen=True)
class LayerLayout:
    """One layer's KV in one region. Structured (``heads`` set): cell ``(head h, token t)`` of
    kernel block ``k`` is ``cell`` bytes at ``base + k*block_stride + (h - heads[0])*head_stride
    + t*token_stride``; scheduler block ``b`` is kernel blocks ``b*kernels ... b*kernels +
    kernels - 1``. Opaque (``heads`` None): ``parts`` are ``(offset, bytes)`` ranges of each
    scheduler block, at ``base + b*block_stride + offset``."""

    name: str
    group: int
    dtype: str
    region: int
    base: int
    block_stride: int
    kernels: int = 1
    tokens: int = 0
    token_stride: int = 0
    heads: tuple[int, int] | None = None
    head_stride: int = 0
    cell: int = 0
    packed: bool = False
    parts: tuple[tuple[int, int], ...] = ()

    @property
    def structured(self) -> bool:
        return self.heads is not None

    @property
    def logical_stride(self) -> int:
        """Bytes from one scheduler block to the next."""
        return self.block_stride * self.kernels

    def offset(self, head: int, token: int) -> int:
        """Where cell (head, token of the scheduler block) lies, from the block's start."""
        assert self.heads is not None
        k, t = divmod(token, self.tokens)
        return (
            self.base
            + k * self.block_stride
            + (head - self.heads[0]) * self.head_stride
            + t * self.token_stride
        )

    def block_bytes(self) -> int:
        """Bytes of one scheduler block that hold KV."""
        if self.heads is None:
            return sum(n for _, n in self.parts)
        return (self.heads[1] - self.heads[0]) * self.tokens * self.kernels * self.cell

    def span(self) -> int:
        """Bytes from a scheduler block's start (``base + b * stride``) to past its last byte
        of this layer."""
        if self.heads is None:
            return max(off + n for off, n in self.parts)
        return (
            (self.kernels - 1) * self.block_stride
            + (self.heads[1] - self.heads[0] - 1) * self.head_stride
            + (self.tokens - 1) * self.token_stride
            + self.cell
        )

    @property
    def stride(self) -> int:
        """Bytes from one scheduler block of the layer to the next (what its planes step by)."""
        return self.block_stride if self.heads is None else self.logical_stride

    def wire(self) -> list[Any]:
        if self.heads is None:
            return [self.name, self.group, self.dtype, self.region, self.base, self.block_stride,
                    [list(p) for p in self.parts]]  # fmt: skip
        return [self.name, self.group, self.dtype, self.region, self.base, self.block_stride,
                self.kernels, self.tokens, self.token_stride, list(self.heads), self.head_stride,
                self.cell, int(self.packed)]  # fmt: skip


@dataclass(frozen=True)
class WorkerLayout:
    """A worker's KV cache: its place in the instance (PP stage, TP rank of TP size) and its
    layers, with the instance's scheduler block size."""

    pp: int
    tp_rank: int
    tp_size: int
    block_size: int
    layers: tuple[LayerLayout, ...]

    def wire(self) -> list[Any]:
        return [self.pp, self.tp_rank, self.tp_size, self.block_size,
                [layer.wire() for layer in self.layers]]  # fmt: skip

    def block_bytes(self) -> int:
        return sum(layer.block_bytes() for layer in self.layers)

    def block_planes(self) -> list[tuple[int, int, int, int]]:
        """Every byte of a scheduler block, over all layers, as few planes as cover it: each
        layer's span, merged where layers touch or overlap (layers of a block kept together;
        hybrid groups sharing one tensor). What a hold on one request's blocks grants: any
        plane a reader's block table names lies within one of these."""
        spans = sorted((x.region, x.stride, x.base, x.base + x.span()) for x in self.layers)
        out: list[list[int]] = []
        for region, stride, lo, hi in spans:
            last = out[-1] if out else None
            # Never wider than a block: the plane would reach into the next block's bytes.
            fits = max(last[3], hi) - last[2] <= stride if last else False
            if last and (last[0], last[1]) == (region, stride) and lo <= last[3] and fits:
                last[3] = max(last[3], hi)
            else:
                out.append([region, stride, lo, hi])
        return [(r, lo, stride, hi - lo) for r, stride, lo, hi in out]


def fingerprint(wire: Any) -> str:
    """A short name for a wire layout (what caches of plans are keyed by)."""
    text = json.dumps(wire, separators=(",", ":"), sort_keys=True)
    return hashlib.blake2b(text.encode(), digest_size=12).hexdigest()


# -- from the wire (untrusted) ----------------------------------------------------------------


def _int(v: Any, field: str, lo: int = 0, hi: int = MAX_BYTES) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise invalid(field, v)
    return v


def _str(v: Any, field: str) -> str:
    if not isinstance(v, str) or not 0 < len(v) <= 256:
        raise invalid(field, v)
    return v


def _list(v: Any, field: str, n: int | None = None, most: int = MAX_LAYERS) -> list[Any]:
    if not isinstance(v, list) or len(v) > most or (n is not None and len(v) != n):
        raise invalid(field, v)
    return v


def layer_from_wire(v: Any, field: str) -> LayerLayout:
    v = _list(v, field, most=13)
    if len(v) not in (7, 13):
        raise invalid(field, v)
    common = {
        "name": _str(v[0], f"{field}.name"),
        "group": _int(v[1], f"{field}.group", hi=1024),
        "dtype": _str(v[2], f"{field}.dtype"),
        "region": _int(v[3], f"{field}.region", hi=1 << 16),
        "base": _int(v[4], f"{field}.base"),
        "block_stride": _int(v[5], f"{field}.block_stride", lo=1),
    }
    if len(v) == 7:
        parts = tuple(
            (
                _int(_list(p, f"{field}.parts", 2)[0], f"{field}.parts.offset"),
                _int(p[1], f"{field}.parts.bytes", lo=1),
            )
            for p in _list(v[6], f"{field}.parts", most=64)
        )
        if not parts:
            raise invalid(f"{field}.parts", v[6])
        return LayerLayout(**common, parts=parts)
    heads = _list(v[9], f"{field}.heads", 2)
    h0 = _int(heads[0], f"{field}.heads", hi=1 << 16)
    h1 = _int(heads[1], f"{field}.heads", lo=h0 + 1, hi=1 << 16)
    return LayerLayout(
        **common,
        kernels=_int(v[6], f"{field}.kernels", lo=1, hi=1 << 16),
        tokens=_int(v[7], f"{field}.tokens", lo=1, hi=1 << 20),
        token_stride=_int(v[8], f"{field}.token_stride"),
        heads=(h0, h1),
        head_stride=_int(v[10], f"{field}.head_stride"),
        cell=_int(v[11], f"{field}.cell", lo=1, hi=1 << 24),
        packed=bool(_int(v[12], f"{field}.packed", hi=1)),
    )


def worker_from_wire(v: Any, field: str) -> WorkerLayout:
    v = _list(v, field, 5)
    tp_size = _int(v[2], f"{field}.tp_size", lo=1, hi=MAX_WORKERS)
    layers = _list(v[4], f"{field}.layers")
    return WorkerLayout(
        pp=_int(v[0], f"{field}.pp", hi=MAX_WORKERS),
        tp_rank=_int(v[1], f"{field}.tp_rank", hi=tp_size - 1),
        tp_size=tp_size,
        block_size=_int(v[3], f"{field}.block_size", lo=1, hi=1 << 20),
        layers=tuple(layer_from_wire(x, f"{field}.layers[{i}]") for i, x in enumerate(layers)),
    )


# -- from vLLM's tensors ----------------------------------------------------------------------


@dataclass(frozen=True)
class LayerSpec:
    """What vLLM's KV cache config says of a layer, as plain values: its group, the scheduler
    block size, the global KV heads this worker holds (``None`` when the layer has no heads to
    split, e.g. a state cache), the dtype's name, and whether its attention backend packs each
    (block, head) for its kernel (vLLM's CPU attention: rows of the view are not tokens)."""

    group: int
    block_size: int
    heads: tuple[int, int] | None
    dtype: str
    packed: bool = False


def kv_heads_of_rank(total: int, tp_rank: int, tp_size: int, mla: bool = False) -> tuple[int, int]:
    """The global KV heads a TP rank holds: an equal share, or (fewer heads than ranks, and
    MLA's single latent) one head replicated over several ranks."""
    if mla or total <= 0:
        return (0, 1)
    if total >= tp_size:
        share = total // tp_size
        return (tp_rank * share, (tp_rank + 1) * share)
    head = tp_rank * total // tp_size
    return (head, head + 1)


def layer_layouts(
    name: str,
    shape: tuple[int, ...],
    strides: tuple[int, ...],
    itemsize: int,
    num_blocks: int,
    spec: LayerSpec,
    region: int,
    offset: int,
) -> tuple[LayerLayout, ...]:
    """The layout of a layer tensor of ``num_blocks`` scheduler blocks at byte ``offset`` of
    region ``region`` (see the module docstring): structured when the view is ``[B, H, N, C]``
    with dense cells, else opaque."""
    if spec.heads is not None and len(shape) == 4:
        blocks, heads, tokens, cell = shape
        sb, sh, st, sc = strides
        kernels, rest = divmod(blocks, num_blocks)
        if (
            not rest
            and kernels > 0
            and heads == spec.heads[1] - spec.heads[0]
            and tokens * kernels == spec.block_size
            and (sc == 1 or cell == 1)
        ):
            return (
                LayerLayout(
                    name=name,
                    group=spec.group,
                    dtype=spec.dtype,
                    region=region,
                    base=offset,
                    block_stride=sb * itemsize,
                    kernels=kernels,
                    tokens=tokens,
                    token_stride=st * itemsize,
                    heads=spec.heads,
                    head_stride=sh * itemsize,
                    cell=cell * itemsize,
                    packed=spec.packed,
                ),
            )
    return (_opaque(name, shape, strides, itemsize, num_blocks, spec, region, offset),)


def _opaque(
    name: str,
    shape: tuple[int, ...],
    strides: tuple[int, ...],
    itemsize: int,
    num_blocks: int,
    spec: LayerSpec,
    region: int,
    offset: int,
) -> LayerLayout:
    """A layer whose blocks are copied whole: a dimension of ``num_blocks`` (or a multiple, when
    the kernel splits blocks) with every dimension after it dense; one part per index of the
    dimensions before it (FlashAttention's old ``(2, blocks, ...)`` gives two: K and V)."""
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
        parts = tuple(
            (sum(i * st for i, st in zip(idx, strides[:d], strict=True)) * itemsize, block_bytes)
            for idx in product(*outer)
        )
        return LayerLayout(
            name=name,
            group=spec.group,
            dtype=spec.dtype,
            region=region,
            base=offset,
            block_stride=block_bytes,
            parts=parts,
        )
    raise InvalidArgument(
        f"invalid kv cache {name}: shape {shape} strides {strides} has no dense dimension of "
        f"{num_blocks} blocks",
        name,
        str(shape),
    )


def tensor_layouts(
    name: str, tensor: Any, num_blocks: int, spec: LayerSpec, region: int, offset: int
) -> tuple[LayerLayout, ...]:
    return layer_layouts(
        name,
        tuple(tensor.shape),
        tuple(tensor.stride()),
        tensor.element_size(),
        num_blocks,
        spec,
        region,
        offset,
    )


def worker_layout(
    kv_caches: dict[str, Any],
    specs: dict[str, LayerSpec],
    num_blocks: int,
    place: tuple[int, int, int, int],
) -> tuple[list[Any], WorkerLayout]:
    """One region per storage the layers live in (vLLM may put several layers in one
    allocation; HMA groups share one), in order of first use, and the worker's layout over
    them. ``place``: (PP stage, TP rank, TP size, scheduler block size). Layers without a spec
    share another layer's KV cache and are left out."""
    import kvfabric

    index: dict[int, int] = {}
    regions: list[Any] = []
    layers: list[LayerLayout] = []
    for name, t in kv_caches.items():
        spec = specs.get(name)
        if spec is None:
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() not in index:
            index[storage.data_ptr()] = len(regions)
            regions.append(kvfabric.storage_tensor(t))
        region = index[storage.data_ptr()]
        offset = t.data_ptr() - storage.data_ptr()
        layers += tensor_layouts(name, t, num_blocks, spec, region, offset)
    pp, tp_rank, tp_size, block_size = place
    return regions, WorkerLayout(pp, tp_rank, tp_size, block_size, tuple(layers))
