"""Publishing the trainer's weights to the engine after each step.

Two strategies say how weights travel:

- `FullWeights`: every weight, gathered out of the trainer into the transport's staging area
  (`stage`, on the trainer thread, which waits), then loaded by the engine inside its critical section (`load`),
  which runs while the next step trains when the transport's copy is a snapshot;
- `AdapterWeights`: only the LoRA adapter, read on the trainer thread and loaded as a new
  adapter version before the next step.

Both give a freshly started engine (a resumed run's, or a dead one's replacement) the trainer's
current weights with their exact version (`prepare`). `WeightPublisher` runs one update at a
time (the staging area is reused) and advances admission once the engine serves the new
version. It does not decide when to publish; the training loop does.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import torch

from rollflow import faults
from rollflow.buffer import Admission
from rollflow.controller.supervisor import Supervisor
from rollflow.controller.trainer_thread import TrainerRunner
from rollflow.engine import ManagedEngine, PartialMode
from rollflow.engine.fingerprint import Expectation, Fingerprint
from rollflow.engine.fingerprint import of as fingerprint_of
from rollflow.trace import Trace
from rollflow.weight_sync import BucketPlan, WeightTransport, expecting, plan_for, publish


class WeightStrategy:
    """What travels to the engine, and how; the shared part of both strategies."""

    snapshots = True
    """`stage` copies the weights: the trainer may change them while the engine loads."""

    def __init__(self, runner: TrainerRunner, partial: PartialMode) -> None:
        self.runner = runner
        self.partial = partial
        self.reading = asyncio.Lock()
        """Held while weights are read out of the trainer (publishing, or preparing an engine)."""

    async def connect(self, engine: ManagedEngine) -> None:
        """One-off setup with a new engine."""

    async def stage(self) -> int:
        """Copy the weights out of the trainer; returns the bytes staged."""
        raise NotImplementedError

    async def load(self, engine: ManagedEngine, version: int) -> None:
        """Load what `stage` copied into `engine`, labelled `version`."""
        raise NotImplementedError

    def read_current(self) -> Any:
        """The trainer's weights in the form `give` takes (on the trainer thread)."""
        raise NotImplementedError

    async def give(self, engine: ManagedEngine, version: int, weights: Any) -> None:
        """Load weights read by `read_current` into a fresh engine, labelled `version`."""
        raise NotImplementedError

    async def prepare(self, engine: ManagedEngine) -> int:
        """Give a freshly started engine the trainer's current weights, labelled with the number
        of steps they carry; returns that version. They are read on the trainer thread, so never
        halfway through a step."""
        await self.connect(engine)

        def read() -> tuple[int, Any]:
            steps = self.runner.steps_run
            return steps, (self.read_current() if steps else None)  # 0: the engine starts with these

        async with self.reading:
            version, weights = await self.runner.call(read)
        if version > 0:
            await self.give(engine, version, weights)
        return version


class FullWeights(WeightStrategy):
    """Every weight through a `WeightTransport` (packed buckets), each load checked: the
    fingerprint of what was staged (`rollflow.engine.fingerprint`, taken on the trainer thread as
    the weights go by) travels with the load, and a load copied into the model in place reads it
    back inside the critical section; a tensor not there fails the load as one that changed the
    model part-way (the engine is replaced)."""

    def __init__(
        self, runner: TrainerRunner, transport: WeightTransport, partial: PartialMode, *, engine_dtype: str = "float32"
    ) -> None:
        super().__init__(runner, partial)
        self.engine_dtype = engine_dtype
        """The dtype the engine holds its weights in (`model.dtype`): the fingerprint's."""
        self.transport = transport
        self.snapshots = transport.snapshots
        self.plan: BucketPlan = plan_for(runner.backend.weight_specs())
        self.expected: Fingerprint | None = None
        """The fingerprint of the last staged update (None: its weights did not all go by)."""

    async def connect(self, engine: ManagedEngine) -> None:
        await self.transport.connect(engine)

    async def stage(self) -> int:
        watcher = Expectation(self.engine_dtype)
        # On the trainer thread: with several ranks the gathers are collectives, in order with the steps.
        weights = watcher.watch(self.runner.backend.full_weights())
        staged = await self.transport.stage(self.plan, weights, run=self.runner.call)
        self.expected = watcher.fingerprint
        return staged

    async def load(self, engine: ManagedEngine, version: int) -> None:
        await publish(engine, self.transport, self.plan, partial=self.partial, version=version, expect=self.expected)

    def read_current(self) -> dict[str, torch.Tensor]:
        return {name: tensor.clone() for name, tensor in self.runner.backend.full_weights()}

    async def give(self, engine: ManagedEngine, version: int, weights: dict[str, torch.Tensor]) -> None:
        await expecting(
            engine,
            fingerprint_of(weights.items(), self.engine_dtype),
            lambda: engine.update_weights(weights, version=version),
        )


class AdapterWeights(WeightStrategy):
    """Only the LoRA adapter; the engine keeps the base weights and serves adapters by version."""

    snapshots = False

    def __init__(self, runner: TrainerRunner, partial: PartialMode) -> None:
        super().__init__(runner, partial)
        self._staged: dict[str, torch.Tensor] = {}

    async def stage(self) -> int:
        self._staged = await self.runner.call(self.read_current)
        return sum(t.numel() * t.element_size() for t in self._staged.values())

    async def load(self, engine: ManagedEngine, version: int) -> None:
        config = self.runner.backend.adapter_config()
        await engine.update_adapter(self._staged, config, partial=self.partial, version=version)

    def read_current(self) -> dict[str, torch.Tensor]:
        return self.runner.backend.adapter_weights()

    async def give(self, engine: ManagedEngine, version: int, weights: dict[str, torch.Tensor]) -> None:
        await engine.update_adapter(weights, self.runner.backend.adapter_config(), version=version)


class WeightPublisher:
    """One weight update at a time, from the trainer to whichever engine serves."""

    def __init__(
        self,
        strategy: WeightStrategy,
        supervisor: Supervisor,
        admission: Admission,
        *,
        trace: Trace,
        clock: Callable[[], float],
    ) -> None:
        self.strategy = strategy
        self.supervisor = supervisor
        self.admission = admission
        self.trace = trace
        self.clock = clock
        self.last_update_s = 0.0
        """How long the engine's last load took."""
        self._update: asyncio.Task[None] | None = None
        """The engine's load of the latest staged weights (runs while the next step trains)."""

    async def publish(self, tg: asyncio.TaskGroup, version: int) -> int:
        """Hand the weights of `version` to the engine; returns the bytes staged.

        Waits for the previous engine update and for the copy out of the trainer; the engine
        then loads in the background when the copy is a snapshot (else before this returns).
        """
        await self.drain()
        async with self.strategy.reading:
            staged = await self.strategy.stage()
        self._update = tg.create_task(self._load(version), name="engine-update")
        if not self.strategy.snapshots:
            await self._update
        return staged

    async def _load(self, version: int) -> None:
        began = self.clock()
        faults.point("weight-sync")

        async def load(engine: ManagedEngine) -> None:
            if engine.version < version:  # else a restarted engine was given these weights already
                await self.strategy.load(engine, version)

        await self.supervisor.guard(load)
        now = self.clock()
        self.last_update_s = now - began
        self.trace.span("engine update", "engine update", began, now, version=self.supervisor.engine.version)
        await self.admission.advance(self.supervisor.engine.version)

    async def drain(self) -> None:
        """Wait until the last published weights are in the engine."""
        if self._update is not None:
            await self._update
