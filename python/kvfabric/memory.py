"""Memory to register: what numpy arrays, torch tensors and kvfabric buffers become.

Host memory must be kvfabric's own (a sealed memfd the agent maps too): a ``HostBuffer``, or an
array or tensor viewing one from its first byte (``host_array``, ``host_tensor``,
``move_to_host_buffer``). CUDA tensors are exported zero-copy with CUDA IPC and named by their
GPU's UUID, so the agent opens the right device whatever its own numbering. In every region,
offset 0 is the registered object's first byte.
"""

from __future__ import annotations

import ctypes
import sys
from typing import Any

import numpy as np

from . import _native
from .errors import InvalidArgument

HostBuffer = _native.HostBuffer
CudaRegion = _native.CudaRegion


def host_array(shape: int | tuple[int, ...], dtype: Any = np.uint8) -> np.ndarray:
    """A zeroed numpy array in a new HostBuffer (registrable)."""
    dt = np.dtype(dtype)
    count = int(np.prod(shape))
    buf = HostBuffer(max(count * dt.itemsize, 1))
    return np.frombuffer(buf, dtype=dt, count=count).reshape(shape)


def host_tensor(shape: int | tuple[int, ...], dtype: Any = None) -> Any:
    """A zeroed CPU torch tensor in a new HostBuffer (registrable)."""
    import torch

    dtype = dtype or torch.uint8
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    count = 1
    for s in shape:
        count *= s
    esize = torch.empty((), dtype=dtype).element_size()
    buf = HostBuffer(max(count * esize, 1))
    return torch.frombuffer(buf, dtype=dtype, count=count).view(shape)


def move_to_host_buffer(*tensors: Any) -> HostBuffer:
    """Moves the storage of CPU tensors into a new HostBuffer, in place: every reference to the
    tensor objects sees the same values, now in memory the agent can map. Tensors viewing one
    storage (vLLM's layers in one allocation) move together, keeping their offsets. Views made
    before the move, of tensors not passed, keep the old storage."""
    import torch

    if not tensors:
        raise InvalidArgument("invalid tensors: none given", "tensors", "()")
    old = tensors[0].untyped_storage()
    for i, t in enumerate(tensors):
        if t.device.type != "cpu" or t.untyped_storage().data_ptr() != old.data_ptr():
            raise InvalidArgument(
                f"invalid tensors[{i}]: {t.device} (only CPU tensors of one storage move together)",
                f"tensors[{i}]",
                str(t.device),
            )
    buf = HostBuffer(max(old.nbytes(), 1))
    new = torch.frombuffer(buf, dtype=torch.uint8)
    if old.nbytes():
        new[: old.nbytes()].copy_(torch.empty(0, dtype=torch.uint8).set_(old))
    with torch.no_grad():
        for t in tensors:
            t.set_(new.untyped_storage(), t.storage_offset(), t.size(), t.stride())
    return buf


def storage_tensor(tensor: Any) -> Any:
    """A flat uint8 tensor over all of ``tensor``'s storage (what a region of it registers)."""
    import torch

    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(tensor.untyped_storage())


def span_bytes(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int) -> int:
    """Bytes from an array's first element to past its last (non-negative strides)."""
    if any(s == 0 for s in shape):
        return 0
    last = sum((n - 1) * st for n, st in zip(shape, strides, strict=True))
    return (last + 1) * itemsize


def _host(ptr: int, nbytes: int, field: str, what: str) -> HostBuffer:
    found = HostBuffer.containing(ptr, nbytes)
    if found is None:
        raise InvalidArgument(
            f"invalid {field}: {what} (host memory must be kvfabric's: kvfabric.HostBuffer, "
            "host_array, host_tensor or move_to_host_buffer)",
            field,
            what,
        )
    buf, offset = found
    if offset:
        raise InvalidArgument(
            f"invalid {field}: {what} starts {offset} bytes into its HostBuffer (register the "
            "buffer, or a view from its first byte)",
            field,
            what,
        )
    return buf


class _Cuda:
    """The driver calls CUDA IPC export needs, through libcuda directly (torch's own sharing
    format is private and changes between releases)."""

    lib: Any = None

    @classmethod
    def call(cls, name: str, *args: Any) -> None:
        if cls.lib is None:
            cls.lib = ctypes.CDLL("libcuda.so.1")
        r = getattr(cls.lib, name)(*args)
        if r != 0:
            raise InvalidArgument(f"invalid CUDA tensor: {name} returned {r}", "tensor", name)

    @classmethod
    def export(cls, ptr: int) -> tuple[bytes, int]:
        """The IPC handle of the allocation holding ``ptr``, and ``ptr``'s offset in it."""
        base = ctypes.c_uint64()
        size = ctypes.c_size_t()
        cls.call(
            "cuMemGetAddressRange_v2", ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr)
        )
        handle = (ctypes.c_ubyte * 64)()
        cls.call("cuIpcGetMemHandle", handle, ctypes.c_uint64(base.value))
        return bytes(handle), ptr - base.value

    @classmethod
    def uuid(cls, ordinal: int) -> str:
        dev = ctypes.c_int()
        cls.call("cuDeviceGet", ctypes.byref(dev), ctypes.c_int(ordinal))
        raw = (ctypes.c_ubyte * 16)()
        cls.call("cuDeviceGetUuid_v2", raw, dev)
        h = bytes(raw).hex()
        return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def _cuda(tensor: Any, field: str) -> CudaRegion:
    import torch

    if any(s < 0 for s in tensor.stride()):
        raise InvalidArgument(f"invalid {field}: negative strides", field, str(tensor.stride()))
    ordinal = tensor.device.index if tensor.device.index is not None else 0
    with torch.cuda.device(ordinal):
        handle, offset = _Cuda.export(tensor.data_ptr())
        uuid = _Cuda.uuid(ordinal)
    span = span_bytes(tuple(tensor.shape), tuple(tensor.stride()), tensor.element_size())
    return CudaRegion(handle, offset, span, device=ordinal, device_uuid=uuid)


def region_of(obj: Any, index: int = 0) -> HostBuffer | CudaRegion:
    """The region ``obj`` registers as: a HostBuffer, CudaRegion, numpy array or torch tensor."""
    field = f"regions[{index}]"
    if isinstance(obj, HostBuffer | CudaRegion):
        return obj
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        if obj.is_cuda:
            return _cuda(obj, field)
        if obj.device.type != "cpu":
            raise InvalidArgument(f"invalid {field}: device {obj.device}", field, str(obj.device))
        span = span_bytes(tuple(obj.shape), tuple(obj.stride()), obj.element_size())
        return _host(obj.data_ptr(), span, field, f"tensor at {obj.data_ptr():#x}")
    if isinstance(obj, np.ndarray):
        ptr = obj.__array_interface__["data"][0]
        if any(s < 0 for s in obj.strides):
            raise InvalidArgument(f"invalid {field}: negative strides", field, str(obj.strides))
        strides = obj.strides if obj.strides else (obj.itemsize,)
        shape = obj.shape if obj.shape else (1,)
        span = span_bytes(tuple(shape), tuple(s // obj.itemsize for s in strides), obj.itemsize)
        return _host(ptr, span, field, f"array at {ptr:#x}")
    raise InvalidArgument(
        f"invalid {field}: {type(obj).__name__} (register a HostBuffer, numpy array, torch tensor "
        "or CudaRegion)",
        field,
        type(obj).__name__,
    )
