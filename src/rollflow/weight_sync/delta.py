"""Changed-elements weight updates: what the `gloo` transport sends once the engine holds a base.

Both ends keep the last set of weights that went between them, packed as the bucket plan lays it
out (the sender: the staged copy it sent; the receiver: its receive buffers). An update then
carries, for each tensor, only what changed since, in whichever form is smallest: nothing (no
element changed), the changed elements' indices (int32) and values, a bitmap of the changed
elements and their values, or the whole tensor. Elements are compared as bits, so the receiver's
buffers end bit-identical to the sender's staged copy (-0.0 and NaN payloads included). At the
learning rates of reinforcement learning, in bfloat16 most values round to themselves after a
step and only a few percent change.

`encode` runs on the trainer side, `apply` in the engine's worker; neither moves bytes between
processes (`rollflow.weight_sync.gloo` does).
"""

from __future__ import annotations

import numpy as np
import torch

from rollflow.weight_sync.buckets import BucketPlan, bucket_starts

SAME, INDICES, BITMAP, WHOLE = 0, 1, 2, 3
"""How one tensor travels in a delta."""

_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _elements(memory: torch.Tensor, at: int, nbytes: int, width: int) -> torch.Tensor:
    return memory[at : at + nbytes].view(_INTS[width])


def _width(dtype: str) -> int:
    return getattr(torch, dtype).itemsize


def encode(plan: BucketPlan, current: torch.Tensor, base: torch.Tensor) -> tuple[list[int], torch.Tensor]:
    """(per tensor of `plan`: how it travels and how many of its elements changed, two numbers
    each; the bytes that carry them back to back): `current` against `base`, both uint8, all
    buckets back to back as `pack_into` lays them out."""
    starts = bucket_starts(plan)
    modes: list[int] = []
    pieces: list[torch.Tensor] = []
    for meta in plan.tensors:
        at, width = starts[meta.bucket] + meta.offset, _width(meta.dtype)
        now = _elements(current, at, meta.nbytes, width)
        changed = now != _elements(base, at, meta.nbytes, width)
        count, n = int(torch.count_nonzero(changed)), now.numel()
        sizes = {INDICES: count * (4 + width), BITMAP: (n + 7) // 8 + count * width, WHOLE: n * width}
        if n >= 2**31:
            del sizes[INDICES]
        mode = SAME if count == 0 else min(sizes, key=lambda m: (sizes[m], -m))  # ties: the simpler form
        modes += [mode, count]
        if mode == INDICES:
            where = changed.nonzero().view(-1)
            pieces += [where.to(torch.int32).view(torch.uint8), now[where].view(torch.uint8)]
        elif mode == BITMAP:
            pieces += [torch.from_numpy(np.packbits(changed.numpy())), now[changed].view(torch.uint8)]
        elif mode == WHOLE:
            pieces.append(current[at : at + meta.nbytes])
    payload = torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.uint8)
    return modes, payload


def apply(plan: BucketPlan, buffers: list[torch.Tensor], modes: list[int], payload: torch.Tensor) -> None:
    """Make `buffers` (the plan's buckets, holding the base) hold the weights `encode` was given
    (`modes` and `payload`, as it returned them)."""
    if len(modes) != 2 * len(plan.tensors):
        raise ValueError(f"a delta for {len(modes) // 2} tensors, the plan has {len(plan.tensors)}")
    used = 0

    def take(nbytes: int) -> torch.Tensor:
        nonlocal used
        if used + nbytes > payload.numel():
            raise ValueError(f"the delta's payload ends at {payload.numel()} bytes, short of what its modes need")
        used += nbytes
        return payload[used - nbytes : used]

    def elements(nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        return take(nbytes).clone().view(dtype)  # a copy of its own: the payload's offsets are not aligned

    for meta, mode, count in zip(plan.tensors, modes[::2], modes[1::2], strict=True):
        width = _width(meta.dtype)
        held = _elements(buffers[meta.bucket], meta.offset, meta.nbytes, width)
        if mode == INDICES:
            where = elements(4 * count, torch.int32).long()
            held[where] = elements(count * width, _INTS[width])
        elif mode == BITMAP:
            bits = np.unpackbits(take((held.numel() + 7) // 8).numpy(), count=held.numel()).astype(bool)
            held[torch.from_numpy(bits)] = elements(count * width, _INTS[width])
        elif mode == WHOLE:
            held.view(torch.uint8).copy_(take(meta.nbytes))
        elif mode != SAME:
            raise ValueError(f"{meta.name}: unknown delta mode {mode}")
    if used != payload.numel():
        raise ValueError(f"the delta's payload has {payload.numel() - used} bytes its modes do not use")
