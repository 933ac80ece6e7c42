"""Weight sync: trainer weights into the live engine, through one critical section.

A `WeightTransport` moves one full set of weights (named tensors in checkpoint naming, laid
out by a `BucketPlan`) from the trainer side into the engine's worker; `sync_weights` runs it
inside the engine's critical section (pause -> transfer and load -> label the new version ->
reset the prefix cache -> resume), under a deadline. Transports:

- `gloo`: a dedicated two-process gloo group between trainer rank 0 and the vLLM worker;
- `shm`: same host, packed buckets in a shared-memory segment the worker loads in place;
- `checkpoint`: safetensors files in a folder (the fallback; also the remote-server route);
- `nccl`: vLLM's NCCL weight-transfer engine (GPU machines; see `rollflow.weight_sync.nccl`).

Transports here run the sending side in this process (trainer rank 0 with the controller).
This package does not decide when to sync; the controller does.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Literal, Protocol

import torch

from rollflow.engine import PartialMode
from rollflow.engine.vllm import VLLMEngine
from rollflow.weight_sync.buckets import DEFAULT_BUCKET_BYTES, BucketPlan, plan_buckets
from rollflow.weight_sync.gloo import GlooSender
from rollflow.weight_sync.shm import ShmSender

TransportName = Literal["gloo", "shm", "checkpoint", "nccl"]
NamedTensors = Iterable[tuple[str, torch.Tensor]]


class WeightTransport(Protocol):
    """Moves one full set of weights into the engine's worker and loads it there."""

    name: str

    async def connect(self, engine: VLLMEngine) -> None:
        """One-off setup with the engine (join groups, open segments)."""
        ...

    async def push(self, engine: VLLMEngine, plan: BucketPlan, tensors: NamedTensors) -> int:
        """Send and load; runs inside the engine's paused critical section. Returns bytes moved."""
        ...

    async def aclose(self) -> None: ...


class GlooTransport:
    """Trainer rank 0 (this process) -> vLLM worker over a dedicated gloo group."""

    name = "gloo"

    def __init__(self, host: str = "127.0.0.1", timeout_s: float = 60.0) -> None:
        self.host = host
        self.timeout_s = timeout_s
        self._sender: GlooSender | None = None

    async def connect(self, engine: VLLMEngine) -> None:
        sender = GlooSender(self.host, 0, self.timeout_s)
        await asyncio.gather(
            asyncio.to_thread(sender.connect),
            engine.rpc("rollflow_gloo_join", self.host, sender.port, self.timeout_s),
        )
        self._sender = sender

    async def push(self, engine: VLLMEngine, plan: BucketPlan, tensors: NamedTensors) -> int:
        if self._sender is None:
            await self.connect(engine)
        assert self._sender is not None
        sender = self._sender
        try:
            sent, _ = await asyncio.gather(
                asyncio.to_thread(sender.send, plan, tensors), engine.rpc("rollflow_gloo_receive")
            )
        except BaseException:
            self._sender = None  # a failed collective leaves the group unusable: rejoin next time
            raise
        return sent

    async def aclose(self) -> None:
        if self._sender is not None:
            self._sender.close()
            self._sender = None


class ShmTransport:
    """Same host: packed buckets in shared memory, loaded by the worker without a socket."""

    name = "shm"

    def __init__(self) -> None:
        self._sender = ShmSender()

    async def connect(self, engine: VLLMEngine) -> None:
        return None

    async def push(self, engine: VLLMEngine, plan: BucketPlan, tensors: NamedTensors) -> int:
        written = await asyncio.to_thread(self._sender.write, plan, tensors)
        await engine.rpc("rollflow_shm_load", self._sender.name, plan.encode())
        return written

    async def aclose(self) -> None:
        self._sender.close()


class CheckpointTransport:
    """safetensors files in a folder, reloaded by the worker (the portable fallback)."""

    name = "checkpoint"

    def __init__(self, directory: str | Path | None = None) -> None:
        self._own = directory is None
        self.directory = Path(directory) if directory else Path(tempfile.mkdtemp(prefix="rollflow-weights-"))

    async def connect(self, engine: VLLMEngine) -> None:
        return None

    def _write(self, tensors: NamedTensors) -> int:
        from safetensors.torch import save_file

        # Write beside the target and rename, so the engine never reads a half-written folder.
        staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=self.directory.parent))
        state = {name: t.detach().contiguous().cpu() for name, t in tensors}
        save_file(state, staging / "model.safetensors")
        if self.directory.exists():
            shutil.rmtree(self.directory)
        os.replace(staging, self.directory)
        return sum(t.numel() * t.element_size() for t in state.values())

    async def push(self, engine: VLLMEngine, plan: BucketPlan, tensors: NamedTensors) -> int:
        written = await asyncio.to_thread(self._write, tensors)
        await engine.rpc("rollflow_load_path", str(self.directory))
        return written

    async def aclose(self) -> None:
        if self._own:
            shutil.rmtree(self.directory, ignore_errors=True)


class NullTransport:
    """Moves nothing: for controller tests and benchmarks with a fake engine."""

    name = "null"

    async def connect(self, engine: object) -> None:
        return None

    async def push(self, engine: object, plan: BucketPlan, tensors: NamedTensors) -> int:
        return 0

    async def aclose(self) -> None:
        return None


def make_transport(name: TransportName, *, host: str = "127.0.0.1", timeout_s: float = 60.0) -> WeightTransport:
    if name == "gloo":
        return GlooTransport(host, timeout_s)
    if name == "shm":
        return ShmTransport()
    if name == "checkpoint":
        return CheckpointTransport()
    if name == "nccl":
        from rollflow.weight_sync.nccl import NcclTransport

        return NcclTransport(host=host)
    raise ValueError(f"unknown weight transport {name!r}; expected gloo, shm, checkpoint or nccl")


def plan_for(
    tensors: dict[str, torch.Tensor] | Iterable[tuple[str, torch.dtype, tuple[int, ...]]],
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> BucketPlan:
    """A bucket plan from a state dict, or from (name, dtype, shape) triples."""
    if isinstance(tensors, dict):
        return plan_buckets(((n, t.dtype, tuple(t.shape)) for n, t in tensors.items()), bucket_bytes)
    return plan_buckets(tensors, bucket_bytes)


async def sync_weights(
    engine: VLLMEngine,
    transport: WeightTransport,
    plan: BucketPlan,
    tensors: NamedTensors,
    *,
    partial: PartialMode = "keep",
    deadline_s: float | None = None,
) -> int:
    """Push one set of weights through `transport` inside the engine's critical section;
    returns the new engine version. Raises `WeightSyncError` / `WeightSyncTimeout` on failure,
    with the engine resumed on its previous weights and version."""
    return await engine.update_weights_with(
        lambda: transport.push(engine, plan, tensors), partial=partial, deadline_s=deadline_s
    )


__all__ = [
    "BucketPlan",
    "CheckpointTransport",
    "GlooTransport",
    "NullTransport",
    "ShmTransport",
    "WeightTransport",
    "make_transport",
    "plan_buckets",
    "plan_for",
    "sync_weights",
]
