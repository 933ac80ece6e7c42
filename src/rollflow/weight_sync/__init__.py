"""Weight sync: trainer weights into the live engine, through one critical section.

A `WeightTransport` moves one full set of weights (named tensors in checkpoint naming, laid
out by a `BucketPlan`) from the trainer side into the engine's worker in two phases: `stage`
copies the weights out of the trainer while the engine keeps generating, and `load` moves the
staged copy into the worker inside the engine's critical section (pause -> transfer and load ->
label the new version -> reset the prefix cache -> resume), under a deadline; `sync_weights`
runs both. A transport whose staged copy is a snapshot (`snapshots = True`) lets the trainer
take its next step while the engine loads. `stage` makes its blocking copy through the `run`
it is given (a worker thread by default; the controller passes its trainer thread, so that the
gathers of sharded weights stay in order with the trainer's other collective calls). Transports:

- `gloo`: a dedicated two-process gloo group between trainer rank 0 and each engine's worker;
- `shm`: same host, packed buckets in a shared-memory segment the worker loads in place;
- `checkpoint`: safetensors files in a folder (the fallback; also the remote-server route);
- `nccl`: vLLM's NCCL weight-transfer engine (GPU machines; see `rollflow.weight_sync.nccl`).

Transports here run the sending side in this process (trainer rank 0 with the controller).
This package does not decide when to sync; the controller does.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Literal, Protocol

import torch

from rollflow.engine import Load, ManagedEngine, PartialMode, WorkerCall, load_callable
from rollflow.engine.fingerprint import Fingerprint
from rollflow.scratch import scratch_dir
from rollflow.weight_sync import gloo, shm
from rollflow.weight_sync.buckets import DEFAULT_BUCKET_BYTES, BucketPlan, pack_into, plan_buckets
from rollflow.weight_sync.gloo import GlooSender
from rollflow.weight_sync.shm import ShmSender

TransportName = Literal["gloo", "shm", "checkpoint", "nccl"]
NamedTensors = Iterable[tuple[str, torch.Tensor]]
Run = Callable[[Callable[[], int]], Awaitable[int]]
"""Where a blocking copy runs: given a function, run it somewhere and await its result."""


def in_thread(fn: Callable[[], int]) -> Awaitable[int]:
    """The default `Run`: a worker thread."""
    return asyncio.to_thread(fn)


class WeightTransport(Protocol):
    """Moves one full set of weights into the engine's worker and loads it there."""

    name: str

    async def connect(self, engine: ManagedEngine) -> None:
        """One-off setup with the engine (join groups, open segments)."""
        ...

    snapshots: bool
    """True when `stage` copies the weights, so the trainer may change them while `load` runs."""

    async def stage(self, plan: BucketPlan, tensors: NamedTensors, run: Run = in_thread) -> int:
        """Copy the weights out of the trainer (the engine keeps generating) inside `run`;
        returns bytes."""
        ...

    async def load(self, engine: ManagedEngine, plan: BucketPlan) -> None:
        """Move the staged weights into the worker and load them; runs inside the engine's paused
        critical section."""
        ...

    def worker_call(self, plan: BucketPlan) -> WorkerCall | None:
        """The load as one worker call when it is one (the engine may then load, label and reset
        its prefix cache in a single call of its own), or None: the load goes through `load`
        (`gloo` and `nccl`: the worker receives while this process sends)."""
        ...

    async def aclose(self) -> None: ...


class GlooTransport:
    """Trainer rank 0 (this process) -> vLLM worker over a dedicated gloo group, one group per
    engine (an engine pool gets one each; the staged copy is packed once for all of them)."""

    name = "gloo"
    snapshots = True

    def __init__(self, host: str = "127.0.0.1", timeout_s: float = 60.0, *, delta: bool = True) -> None:
        self.host = host
        self.timeout_s = timeout_s
        self.delta = delta
        """After the first sync with an engine, send only the elements that changed
        (`rollflow.weight_sync.delta`); a new or rejoined engine gets every byte."""
        self._senders: dict[int, GlooSender] = {}
        """id(engine) -> the sending end of its group."""
        self._staged = torch.empty(0, dtype=torch.uint8)

    async def connect(self, engine: ManagedEngine) -> None:
        """Join a group with every engine behind `engine` (a restart's new engine replaces the old)."""
        for sender in self._senders.values():
            sender.close()
        self._senders = {}
        await asyncio.gather(*(self._join(member) for member in engine.engines()))

    async def _join(self, member: ManagedEngine) -> None:
        sender = GlooSender(self.host, 0, self.timeout_s)
        await asyncio.gather(
            asyncio.to_thread(sender.connect),
            member.rpc("rollflow_open_receiver", gloo.RECEIVER, self.host, sender.port, self.timeout_s),
        )
        self._senders[id(member)] = sender

    async def stage(self, plan: BucketPlan, tensors: NamedTensors, run: Run = in_thread) -> int:
        if self._staged.numel() < plan.total_bytes:
            self._staged = torch.empty(plan.total_bytes, dtype=torch.uint8)
        staged = self._staged
        return await run(lambda: pack_into(plan, tensors, staged))

    def worker_call(self, plan: BucketPlan) -> None:
        """None: the worker receives while this process sends (`load`)."""
        return None

    async def load(self, engine: ManagedEngine, plan: BucketPlan) -> None:
        for key in set(self._senders) - {id(m) for m in engine.engines()}:  # engines taken out of a pool
            self._senders.pop(key).close()
        await asyncio.gather(*(self._send(member, plan) for member in engine.targets()))

    async def _send(self, member: ManagedEngine, plan: BucketPlan) -> None:
        if id(member) not in self._senders:
            await self._join(member)
        sender = self._senders[id(member)]
        try:
            await asyncio.gather(
                asyncio.to_thread(sender.send_packed, plan, self._staged, changes=self.delta),
                member.rpc("rollflow_receive", gloo.RECEIVER),
            )
        except BaseException:
            self._senders.pop(id(member), None)  # a failed collective leaves the group unusable: rejoin
            sender.close()
            raise

    async def aclose(self) -> None:
        for sender in self._senders.values():
            sender.close()
        self._senders = {}


class ShmTransport:
    """Same host: packed buckets in shared memory, loaded by the worker without a socket."""

    name = "shm"
    snapshots = True

    def __init__(self) -> None:
        self._sender = ShmSender()

    async def connect(self, engine: ManagedEngine) -> None:
        return None

    async def stage(self, plan: BucketPlan, tensors: NamedTensors, run: Run = in_thread) -> int:
        return await run(lambda: self._sender.write(plan, tensors))

    async def load(self, engine: ManagedEngine, plan: BucketPlan) -> None:
        await load_callable(engine, self.worker_call(plan))()

    def worker_call(self, plan: BucketPlan) -> WorkerCall:
        return WorkerCall("rollflow_receive", (shm.RECEIVER, self._sender.name, plan.encode()))

    async def aclose(self) -> None:
        self._sender.close()


class CheckpointTransport:
    """safetensors files in a folder, reloaded by the worker (the portable fallback)."""

    name = "checkpoint"
    snapshots = True

    def __init__(self, directory: str | Path | None = None) -> None:
        self._own = directory is None
        self.directory = Path(directory) if directory else scratch_dir("weights") / "model"

    async def connect(self, engine: ManagedEngine) -> None:
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

    async def stage(self, plan: BucketPlan, tensors: NamedTensors, run: Run = in_thread) -> int:
        return await run(lambda: self._write(tensors))

    async def load(self, engine: ManagedEngine, plan: BucketPlan) -> None:
        await load_callable(engine, self.worker_call(plan))()

    def worker_call(self, plan: BucketPlan) -> WorkerCall:
        return WorkerCall("rollflow_load_path", (str(self.directory),))

    async def aclose(self) -> None:
        if self._own:  # the scratch folder, with any staging folder left beside the weights
            shutil.rmtree(self.directory.parent, ignore_errors=True)


def make_transport(
    name: TransportName, *, host: str = "127.0.0.1", timeout_s: float = 60.0, delta: bool = True
) -> WeightTransport:
    """The transport `name`; `delta`: `gloo` sends only what changed after the first sync."""
    if name == "gloo":
        return GlooTransport(host, timeout_s, delta=delta)
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
    engine: ManagedEngine,
    transport: WeightTransport,
    plan: BucketPlan,
    tensors: NamedTensors,
    *,
    partial: PartialMode = "keep",
    deadline_s: float | None = None,
) -> int:
    """Stage one set of weights in `transport`, then load them inside the engine's critical
    section; returns the new engine version. Raises `WeightSyncError` / `WeightSyncTimeout` on
    failure when the engine provably keeps its previous weights and version, `EngineDeadError`
    when it was taken out of service because its weights are no longer known."""
    await transport.stage(plan, tensors)
    return await publish(engine, transport, plan, partial=partial, deadline_s=deadline_s)


async def publish(
    engine: ManagedEngine,
    transport: WeightTransport,
    plan: BucketPlan,
    *,
    partial: PartialMode = "keep",
    deadline_s: float | None = None,
    version: int | None = None,
    expect: Fingerprint | None = None,
) -> int:
    """Load the weights staged in `transport` inside the engine's critical section; returns the
    new engine version (`version`: label them with this one instead of the next). `expect`: the
    fingerprint of the staged weights (`rollflow.engine.fingerprint`), which the workers check
    the load against: in the same worker call as the load where the transport loads with one
    (`rollflow_checked`), else handed over first in the critical section."""
    call = transport.worker_call(plan)
    load: Load
    if call is not None:
        load = call if expect is None else WorkerCall("rollflow_checked", (expect, call.method, *call.args))
    else:
        load = lambda: expecting(engine, expect, lambda: transport.load(engine, plan))  # noqa: E731
    return await engine.update_weights_with(load, partial=partial, deadline_s=deadline_s, version=version)


async def expecting(
    engine: ManagedEngine, fingerprint: Fingerprint | None, load: Callable[[], Awaitable[object]]
) -> None:
    """Run `load` with `fingerprint` handed to the engine's workers first (`rollflow_expect`), so
    the load is checked against it; if the load fails short of consuming it, it is withdrawn, so
    no later load is checked against it."""
    if fingerprint is None:
        await load()
        return
    await engine.rpc("rollflow_expect", fingerprint)
    try:
        await load()
    except BaseException:
        with contextlib.suppress(Exception):
            await engine.rpc("rollflow_expect", None)
        raise


__all__ = [
    "BucketPlan",
    "CheckpointTransport",
    "GlooTransport",
    "ShmTransport",
    "WeightTransport",
    "expecting",
    "in_thread",
    "make_transport",
    "plan_buckets",
    "plan_for",
    "publish",
    "sync_weights",
]
