"""Simulated engine, trainer and weight transport, timed on the loop's clock.

- `SimEngine`: the `Engine` contract of `FakeEngine` (streaming, abort, pause, preemption, exact
  per-token versions) with a continuous-batching performance model: each of `replicas`
  data-parallel engines runs one step at a time over its running requests (at most
  `max_num_seqs`; later ones wait), a step takes `step_s(batch, context tokens)` (a measured
  table over batch sizes, or a line) plus the prefill of newly admitted prompts (once per
  group: its other samples hit the prefix cache), and every running request gets one token per
  step.
  Requests go to the replica with the fewest running + waiting requests. After a weight
  update, running requests prefill their whole context again (the KV cache was dropped).
  Engines and trainer on one host slow each other down by their `contended` factors.
- `SimTrainer`: a step takes `fixed_s + model tokens × s_per_token / gpus`, the model tokens
  being those the trainer's own plan puts through the model in its layout
  (`rollflow.trainer.batches.model_tokens`: each group's prompt once with `shared_prompt`).
- `SimTransport`: staging and loading take bytes / bandwidth (+ a fixed cost per load); with a
  `delta_fraction` below 1, every load after the first moves that share of the bytes, after a
  scan of all of them (the changed elements only, to a remote engine).
- Request lengths come from a `LengthModel` (`rollflow.sim.lengths`).

Time is whatever the running loop says (`VirtualTimeLoop` in a simulation). These are models,
not measurements: `rollflow.sim.profiles` documents where their numbers come from.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from rollflow.engine.pool import group_key
from rollflow.records import TrainBatch
from rollflow.sim.lengths import LengthModel
from rollflow.testing import FakeEngine, FakeTrainer
from rollflow.trainer import TrainerBackend
from rollflow.trainer.batches import Layout, model_tokens

T = TypeVar("T")


@dataclass(frozen=True)
class EngineProfile:
    """Time of one continuous-batching decode step on one engine replica: a measured table over
    batch sizes (`step_table`, interpolated), or `fixed_s + per_seq_s × batch`."""

    fixed_s: float
    """Per step, whatever the batch (reading the weights, scheduling)."""
    per_seq_s: float
    """Per running sequence in the step."""
    step_table: tuple[tuple[int, float], ...] = ()
    """Measured decode step seconds by batch size, ascending ((4, 0.0019), (16, 0.0029), ...):
    when given, a step's time at batch b is interpolated linearly between the two sizes around
    b (beyond the ends, along the nearest segment) instead of `fixed_s + per_seq_s × b`, since
    a CPU's step is not linear in the batch."""
    per_context_token_s: float = 0.0
    """Per token of context (prompt + generated) of every running sequence (reading KV)."""
    prefill_per_token_s: float = 0.0
    """Per prompt token of a newly admitted request (paid in the step that admits it), once per
    GRPO group: the group's other samples find its prompt in the prefix cache."""
    max_num_seqs: int = 256
    contended: float = 1.0
    """Step-time factor while the trainer computes: engines and trainer sharing a host's cores
    or memory bandwidth (a CPU machine) slow each other down; 1.0 on separate GPUs."""
    recompute_on_update: bool = True
    """A weight update drops the KV cache: requests kept running (`keep` mode) prefill their
    whole context again in their next step (rollflow's default, `engine.keep_kv_on_update`
    false)."""

    def decode_s(self, batch: int) -> float:
        """The decode step's time at `batch` running sequences, context aside."""
        table = self.step_table
        if not table:
            return self.fixed_s + self.per_seq_s * batch
        if len(table) == 1:
            return table[0][1]
        k = next((i for i in range(1, len(table) - 1) if batch <= table[i][0]), len(table) - 1)
        (b0, s0), (b1, s1) = table[k - 1], table[k]
        return max(0.0, s0 + (s1 - s0) * (batch - b0) / (b1 - b0))

    def step_s(self, batch: int, context_tokens: int, prefill_tokens: int = 0) -> float:
        return (
            self.decode_s(batch) + self.per_context_token_s * context_tokens + self.prefill_per_token_s * prefill_tokens
        )


@dataclass(frozen=True)
class TrainerProfile:
    """Time of one optimizer step and of moving the weights to the engines."""

    s_per_token: float
    """Forward + backward time per model token on one GPU: per token the trainer's layout puts
    through the model (`rollflow.trainer.batches.model_tokens`: padding included, each group's
    prompt once with `shared_prompt`)."""
    layout: Layout = "shared_prompt"
    """The trainer's layout (`trainer.layout`), which decides the model tokens of a batch."""
    micro_batch_tokens: int = 4096
    """The trainer's micro-batch budget (`trainer.micro_batch_tokens`; padding depends on it)."""
    fixed_s: float = 0.0
    """Per step (optimizer step, gradient clipping, synchronisation)."""
    weight_bytes: int = 0
    stage_bytes_per_s: float = math.inf
    """Copying the weights out of the trainer (the trainer waits for it)."""
    sync_bytes_per_s: float = math.inf
    """Moving the weights into the engines (inside the engines' paused critical section)."""
    sync_fixed_s: float = 0.0
    delta_fraction: float = 1.0
    """Bytes an update moves once the engine holds a base (its first load moves every byte), as
    a share of `weight_bytes`: 1.0 moves every byte; below it, only the changed elements
    (`run.weight_delta` to remote engines; `bench/weight_sync.py` measures the share as
    `delta_bytes_frac`, about 0.015 for SmolLM2-135M in bfloat16 at a learning rate of 1e-6)."""
    delta_scan_bytes_per_s: float = math.inf
    """Finding the changed elements before a delta is sent: the sender compares every byte of
    the weights with the last sync's (the engine serves on meanwhile)."""
    snapshots: bool = True
    """False when the transfer reads the trainer's own tensors (NCCL): the trainer waits for it."""
    contended: float = 1.0
    """Step-time factor while an engine is generating (see `EngineProfile.contended`)."""
    contended_batch: int = 0
    """The engine batch at which `contended` was measured: a step that starts while the engines
    run fewer requests is slowed in proportion (the engine's memory traffic and the loop's work
    on its outputs grow with its batch); 0 applies `contended` whatever the batch."""


@dataclass
class _Replica:
    profile: EngineProfile
    pending: dict[str, tuple[asyncio.Future[None], int]] = field(default_factory=dict)
    """Requests waiting for their next token: future and context length."""
    running: set[str] = field(default_factory=set)
    queue: deque[str] = field(default_factory=deque)
    """Requests not admitted yet, in arrival order."""
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    busy_s: float = 0.0
    stepping: bool = False
    recompute: set[str] = field(default_factory=set)
    """Running requests whose KV was dropped by a weight update."""
    cached: set[str] = field(default_factory=set)
    """Groups whose prompt is in this replica's prefix cache (emptied by a weight update)."""


class SimEngine(FakeEngine):
    """`FakeEngine`'s tokens on a continuous-batching timing model (see the module docstring)."""

    def __init__(self, profile: EngineProfile, lengths: LengthModel, *, replicas: int = 1) -> None:
        super().__init__()
        self.profile = profile
        self.lengths = lengths
        self.replicas = [_Replica(profile) for _ in range(replicas)]
        self._placement: dict[str, _Replica] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self.trainer: SimTrainer | None = None
        """Set when engine and trainer share a host (`contended` factors apply)."""
        self.preempted_tokens = 0
        """Tokens of requests that ended preempted by a weight update (`resume` / `restart`)."""

    async def start(self) -> SimEngine:
        self._tasks = [
            asyncio.create_task(self._schedule(r), name=f"sim-engine-{i}") for i, r in enumerate(self.replicas)
        ]
        return self

    async def aclose(self) -> None:
        await super().aclose()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    @property
    def generating(self) -> bool:
        return any(r.stepping for r in self.replicas)

    @property
    def running(self) -> int:
        """Requests the replicas run now."""
        return sum(len(r.running) for r in self.replicas)

    @property
    def busy_s(self) -> float:
        """Replica-seconds spent in steps."""
        return sum(r.busy_s for r in self.replicas)

    def _stop_at(self, request_id: str, prompt_token_ids: list[int]) -> int | None:
        return self.lengths.length(request_id)

    async def update_weights_with(self, load: Any, **kwargs: Any) -> int:
        version = await super().update_weights_with(load, **kwargs)
        if self.profile.recompute_on_update:
            for replica in self.replicas:
                replica.recompute |= replica.running
        for replica in self.replicas:  # the prefix cache is reset with every update
            replica.cached.clear()
        return version

    async def _step_wait(self, request_id: str, context_tokens: int) -> None:
        replica = self._placement.get(request_id)
        if replica is None:
            replica = min(self.replicas, key=lambda r: len(r.running) + len(r.queue))
            self._placement[request_id] = replica
            replica.queue.append(request_id)
        future = asyncio.get_running_loop().create_future()
        replica.pending[request_id] = (future, context_tokens)
        replica.wake.set()
        await future

    def _leave(self, request_id: str, tokens: int) -> None:
        if request_id in self._preempted:
            self.preempted_tokens += tokens
        replica = self._placement.pop(request_id, None)
        if replica is None:
            return
        replica.running.discard(request_id)
        replica.recompute.discard(request_id)
        if request_id in replica.queue:
            replica.queue.remove(request_id)
        entry = replica.pending.pop(request_id, None)
        if entry is not None and not entry[0].done():
            entry[0].cancel()

    async def _schedule(self, replica: _Replica) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._running.wait()  # paused: no steps
            prefill = 0
            while replica.queue and len(replica.running) < self.profile.max_num_seqs:
                request_id = replica.queue.popleft()
                replica.running.add(request_id)
                group = group_key(request_id)
                if request_id in replica.pending and group not in replica.cached:
                    replica.cached.add(group)
                    prefill += replica.pending[request_id][1]
            batch = [r for r in replica.running if r in replica.pending]
            if not batch:
                replica.wake.clear()
                await replica.wake.wait()
                continue
            context = sum(replica.pending[r][1] for r in batch)
            prefill += sum(replica.pending[r][1] for r in batch if r in replica.recompute)
            replica.recompute.clear()
            began = loop.time()
            step = self.profile.step_s(len(batch), context, prefill)
            if self.trainer is not None and self.trainer.busy:
                step *= self.profile.contended
            replica.stepping = True
            await asyncio.sleep(step)
            replica.stepping = False
            replica.busy_s += loop.time() - began
            for request_id in batch:
                entry = replica.pending.pop(request_id, None)
                if entry is not None and not entry[0].done():
                    entry[0].set_result(None)
            # Let every request take its token and ask for the next before the next step.
            await asyncio.sleep(0)
            await asyncio.sleep(0)


class SimTrainer:
    """A `TrainerRunner` whose step is a timed sleep on the loop's clock instead of compute."""

    def __init__(self, profile: TrainerProfile, gpus: int = 1) -> None:
        self.profile = profile
        self.gpus = gpus
        self._weightless = FakeTrainer()
        self.backend: TrainerBackend = self._weightless
        """No weights: the transport models the bytes."""
        self.steps_run = 0
        self.busy = False
        self.engine: SimEngine | None = None
        """Set when engine and trainer share a host (`contended` factors apply)."""

    def step_s(self, batch: TrainBatch) -> float:
        profile = self.profile
        tokens = model_tokens(batch.samples, profile.micro_batch_tokens, profile.layout)
        return profile.fixed_s + tokens * profile.s_per_token / self.gpus

    def contention(self) -> float:
        """The step-time factor of the engines' work on a shared host as a step starts."""
        profile, engine = self.profile, self.engine
        if engine is None or not engine.generating:
            return 1.0
        if not profile.contended_batch:
            return profile.contended
        share = min(1.0, engine.running / (profile.contended_batch * len(engine.replicas)))
        return 1.0 + (profile.contended - 1.0) * share

    async def step(self, batch: TrainBatch) -> dict[str, float]:
        loop = asyncio.get_running_loop()
        began = loop.time()
        step = self.step_s(batch) * self.contention()
        self.busy = True
        try:
            await asyncio.sleep(step)
        finally:
            self.busy = False
        tokens = sum(sum(s.loss_mask) for s in batch.samples)
        self._weightless.micro_batches = [(began, loop.time(), len(batch.samples), tokens)]
        self.steps_run = batch.step + 1
        return {"ratio_mean": 1.0, "loss": 0.0}

    async def call(self, fn: Callable[[], T]) -> T:
        return fn()

    async def aclose(self) -> None:
        return None


class SimTransport:
    """Weight sync timed by bytes and bandwidth."""

    name = "sim"

    def __init__(self, profile: TrainerProfile) -> None:
        self.profile = profile
        self.snapshots = profile.snapshots
        self.loaded_bytes: list[int] = []
        """Bytes each load moved, in order."""

    def worker_call(self, plan: Any) -> None:
        """None: no single worker call loads these weights (`load` does)."""
        return None

    async def connect(self, engine: Any) -> None:
        return None

    async def stage(self, plan: Any, tensors: Any, run: Any = None) -> int:
        for _ in tensors:
            pass
        await asyncio.sleep(self.profile.weight_bytes / self.profile.stage_bytes_per_s)
        return self.profile.weight_bytes

    async def load(self, engine: Any, plan: Any) -> None:
        profile = self.profile
        delta = bool(self.loaded_bytes) and profile.delta_fraction < 1.0  # the engine holds a base
        moved = round(profile.weight_bytes * profile.delta_fraction) if delta else profile.weight_bytes
        scan = profile.weight_bytes / profile.delta_scan_bytes_per_s if delta else 0.0
        self.loaded_bytes.append(moved)
        await asyncio.sleep(profile.sync_fixed_s + scan + moved / profile.sync_bytes_per_s)

    async def aclose(self) -> None:
        return None
