"""The `shm` transport: same host, buckets written into shared memory, loaded from it in place.

The trainer side writes every bucket into one POSIX shared-memory segment (created once,
reused while the model size is unchanged); the engine side maps the segment and hands the
loader views into it, so no socket and no extra copy sit between the two. The sender finishes
writing before the engine is asked to load, so a sender that dies mid-write leaves the engine's
weights untouched. This module does not pause the engine or bump versions.
"""

from __future__ import annotations

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
