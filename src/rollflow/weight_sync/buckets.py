"""The packed bucket format: many tensors as a few fixed-size byte buffers, and back.

A `BucketPlan` is computed from names, dtypes and shapes alone (sender and receiver agree on it
before any data moves): tensors are laid out in order, each at an aligned offset inside a bucket
of at most `bucket_bytes` (a tensor larger than that gets a bucket of its own). The sender
copies tensors into a bucket buffer; the receiver turns a bucket buffer back into named views
without copying. This module moves no bytes between processes; the transports do.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import msgspec
import torch

ALIGN = 64
"""Byte alignment of every tensor inside a bucket (cache line; a multiple of every dtype size)."""

DEFAULT_BUCKET_BYTES = 64 * 1024 * 1024
"""Bucket size: large enough to amortise per-message costs, small enough to stream."""


class TensorMeta(msgspec.Struct, frozen=True, array_like=True):
    name: str
    dtype: str
    """torch dtype name without the `torch.` prefix, e.g. `float32`."""
    shape: list[int]
    bucket: int
    offset: int
    nbytes: int


class BucketPlan(msgspec.Struct, frozen=True):
    """Where every tensor lives: which bucket, at which offset."""

    tensors: list[TensorMeta]
    bucket_sizes: list[int]

    @property
    def total_bytes(self) -> int:
        return sum(self.bucket_sizes)

    def in_bucket(self, index: int) -> list[TensorMeta]:
        return [t for t in self.tensors if t.bucket == index]

    def encode(self) -> bytes:
        return msgspec.msgpack.encode(self)

    @staticmethod
    def decode(data: bytes) -> BucketPlan:
        return msgspec.msgpack.decode(data, type=BucketPlan)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in bucket plan")
    return dtype


def plan_buckets(
    specs: Iterable[tuple[str, torch.dtype, tuple[int, ...] | torch.Size]], bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> BucketPlan:
    """Lay out (name, dtype, shape) in order into buckets of at most `bucket_bytes`."""
    tensors: list[TensorMeta] = []
    sizes: list[int] = []
    used = 0
    for name, dtype, shape in specs:
        nbytes = _dtype(dtype_name(dtype)).itemsize * int(torch.Size(shape).numel())
        offset = -(-used // ALIGN) * ALIGN
        if sizes and offset + nbytes > bucket_bytes and used > 0:
            sizes[-1] = used
            offset, used = 0, 0
            sizes.append(0)
        if not sizes:
            sizes.append(0)
        tensors.append(TensorMeta(name, dtype_name(dtype), list(shape), len(sizes) - 1, offset, nbytes))
        used = offset + nbytes
    if sizes:
        sizes[-1] = used
    return BucketPlan(tensors=tensors, bucket_sizes=sizes)


def pack(
    plan: BucketPlan, tensors: Iterable[tuple[str, torch.Tensor]], scratch: torch.Tensor | None = None
) -> Iterator[tuple[int, torch.Tensor]]:
    """Copy tensors (in plan order) into bucket buffers; yield (index, uint8 buffer) per bucket.

    With `scratch` (uint8, at least the largest bucket), every bucket is built in it: the caller
    must be done with one bucket before asking for the next. Reusing warm memory avoids paying
    page faults on a fresh buffer for every bucket of every sync.
    """
    index, buffer = -1, torch.empty(0, dtype=torch.uint8)
    for meta, flat in _in_plan_order(plan, tensors):
        if meta.bucket != index:
            if index >= 0:
                yield index, buffer
            index = meta.bucket
            size = plan.bucket_sizes[index]
            if scratch is not None and scratch.numel() >= size:
                buffer = scratch[:size]
            else:
                buffer = torch.empty(size, dtype=torch.uint8)
        buffer[meta.offset : meta.offset + meta.nbytes].copy_(flat)
    if index >= 0:
        yield index, buffer


def _in_plan_order(
    plan: BucketPlan, tensors: Iterable[tuple[str, torch.Tensor]]
) -> Iterator[tuple[TensorMeta, torch.Tensor]]:
    """Each tensor with its place in the plan, as flat bytes; the names, order, shapes and dtypes
    must match the plan exactly."""
    metas = iter(plan.tensors)
    for name, tensor in tensors:
        meta = next(metas, None)
        if meta is None or meta.name != name:
            raise ValueError(f"tensor {name!r} is not the next one in the bucket plan ({meta and meta.name!r})")
        if list(tensor.shape) != meta.shape or dtype_name(tensor.dtype) != meta.dtype:
            raise ValueError(f"{name}: expected {meta.dtype}{meta.shape}, got {tensor.dtype}{list(tensor.shape)}")
        # No `.cpu()`: `copy_` into the destination moves the bytes once, GPU to GPU or GPU to
        # pinned memory, instead of through a pageable host copy.
        yield meta, tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    if next(metas, None) is not None:
        raise ValueError("fewer tensors than the bucket plan lists")


def bucket_starts(plan: BucketPlan) -> list[int]:
    """Where each bucket begins when all buckets are laid back to back in one buffer."""
    starts, at = [], 0
    for size in plan.bucket_sizes:
        starts.append(at)
        at += size
    return starts


def pack_into(plan: BucketPlan, tensors: Iterable[tuple[str, torch.Tensor]], memory: torch.Tensor) -> int:
    """Copy tensors (in plan order) straight to their places in `memory` (uint8, all buckets back
    to back; no intermediate bucket buffer); returns bytes written."""
    starts = bucket_starts(plan)
    for meta, flat in _in_plan_order(plan, tensors):
        at = starts[meta.bucket] + meta.offset
        memory[at : at + meta.nbytes].copy_(flat)
    return plan.total_bytes


def unpack(plan: BucketPlan, index: int, buffer: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Named views into one bucket buffer (no copy)."""
    if buffer.numel() != plan.bucket_sizes[index]:
        raise ValueError(f"bucket {index}: expected {plan.bucket_sizes[index]} bytes, got {buffer.numel()}")
    views = []
    for meta in plan.in_bucket(index):
        raw = buffer[meta.offset : meta.offset + meta.nbytes]
        views.append((meta.name, raw.view(_dtype(meta.dtype)).view(meta.shape)))
    return views
