"""The `shm` transport: same host, buckets written into shared memory, loaded from it in place.

Both halves are here. The trainer side (`ShmSender`, in this process, called by
`rollflow.weight_sync.ShmTransport`) writes every bucket into one POSIX shared-memory segment
(created once, reused while the model size is unchanged); the engine side (`ShmReceiver`, in
vLLM's worker, made from the name the sender gives, `RECEIVER`, and known there only as a
`rollflow.engine.worker.Receiver`) maps the segment and hands the loader
views into it, so no socket and no extra copy sit between the two. The sender finishes writing
before the engine is asked to load, so a sender that dies mid-write leaves the engine's weights
untouched. This module does not pause the engine or bump versions.
"""

from __future__ import annotations

import base64
import contextlib
import gc
import os
import secrets
from collections.abc import Iterable, Iterator
from multiprocessing import shared_memory

import torch

from rollflow.weight_sync.buckets import BucketPlan, bucket_starts, pack_into, unpack


class ShmSender:
    """The trainer end: owns the segment; `write` lays out one full set of weights in it."""

    def __init__(self) -> None:
        self._segment: shared_memory.SharedMemory | None = None

    @property
    def name(self) -> str:
        if self._segment is None:
            raise RuntimeError("nothing written yet")
        return self._segment.name

    def write(self, plan: BucketPlan, tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy each tensor straight to its place in the segment; returns bytes written."""
        total = plan.total_bytes
        if self._segment is None or self._segment.size < total:
            self.close()
            self._segment = shared_memory.SharedMemory(
                name=f"rollflow-{secrets.token_hex(6)}", create=True, size=max(total, 1)
            )
        memory = torch.frombuffer(self._segment.buf, dtype=torch.uint8, count=total)
        pack_into(plan, tensors, memory)
        del memory
        return total

    def close(self) -> None:
        if self._segment is not None:
            self._segment.close()
            self._segment.unlink()
            self._segment = None


class _Mapping:
    """A read mapping of a segment, opened by path (no resource-tracker registration)."""

    def __init__(self, name: str, size: int) -> None:
        import mmap

        fd = os.open(f"/dev/shm/{name.lstrip('/')}", os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.buf = memoryview(self._map)

    def close(self) -> None:
        self.buf.release()
        self._map.close()


def map_segment(name: str, size: int) -> _Mapping:
    """The engine end: map a segment by path rather than through `SharedMemory`, so this process
    never registers (or unlinks) it: its owner does. The caller closes it."""
    return _Mapping(name, size)


def read_buckets(segment: _Mapping, plan: BucketPlan) -> Iterator[tuple[str, torch.Tensor]]:
    """Named views into a mapped segment, bucket by bucket (valid while it stays mapped)."""
    memory = torch.frombuffer(segment.buf, dtype=torch.uint8, count=plan.total_bytes)
    starts = bucket_starts(plan)
    for index, size in enumerate(plan.bucket_sizes):
        yield from unpack(plan, index, memory[starts[index] : starts[index] + size])


RECEIVER = f"{__name__}:ShmReceiver"
"""How the sender names its receiving end to the engine's worker (`rollflow.engine.worker.Receiver`)."""


class ShmReceiver:
    """The engine end: named views into the segment of each load. The mapping stays open for the
    next load from the same segment (the sender rewrites it in place between loads), so a load
    neither maps nor unmaps; a segment of another name or size replaces it. The views of the
    last (segment, plan) are kept too (making them costs more than copying a small model)."""

    stageable = True
    """Its views are into a segment the sender wrote before the load was asked for."""

    def __init__(self) -> None:
        self._mapping: tuple[tuple[str, int], _Mapping] | None = None
        self._views: tuple[tuple[str, bytes | str], tuple[int, list[tuple[str, torch.Tensor]]]] | None = None

    def open(self) -> None:
        """Nothing to open: each load names its segment."""

    def receive(self, name: str, plan: bytes | str) -> tuple[int, list[tuple[str, torch.Tensor]]]:
        """(bytes, named views) of the `BucketPlan` encoded in `plan` (or its base64 text, as a
        remote client's `/collective_rpc` carries it) laid out in the segment `name`: the same
        list for the same segment and plan."""
        if self._views is not None and self._views[0] == (name, plan):
            return self._views[1]
        decoded = BucketPlan.decode(base64.b64decode(plan) if isinstance(plan, str) else plan)
        key = (name, max(decoded.total_bytes, 1))
        if self._mapping is None or self._mapping[0] != key:
            self.close()
            self._mapping = (key, map_segment(*key))
        read = (decoded.total_bytes, list(read_buckets(self._mapping[1], decoded)))
        self._views = ((name, plan), read)
        return read

    def close(self) -> None:
        self._views = None
        if self._mapping is None:
            return
        mapping, self._mapping = self._mapping[1], None
        try:
            mapping.close()
        except BufferError:  # a view of the old segment is still referenced: collect, then unmap
            gc.collect()
            with contextlib.suppress(BufferError, ValueError):
                mapping.close()  # else the mapping goes with the process
