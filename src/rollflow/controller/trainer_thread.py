"""Where the trainer's calls run: one dedicated thread, so the event loop keeps streaming.

`TrainerRunner` is what the controller needs to drive a trainer: a step, any other call made
between steps, and the number of steps whose weights the trainer holds. `TrainerThread` is the
real one: every call runs on the same thread (bound to `run.trainer_cpus`), and with several
ranks the trainer is wrapped in `rollflow.ranks.Leader` so the other ranks make each call too.
The simulator passes its own runner, timed on virtual time. Nothing here decides what to train.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol, TypeVar

from rollflow.ranks import Leader
from rollflow.records import TrainBatch
from rollflow.trainer import TrainerBackend

T = TypeVar("T")


class TrainerRunner(Protocol):
    """How the controller calls a trainer."""

    backend: TrainerBackend
    """The trainer whose weights are read (on rank 0 with several ranks: its `Leader`)."""
    steps_run: int
    """Optimizer steps the trainer's weights carry (set by a restored checkpoint)."""

    async def step(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer step; the event loop keeps running meanwhile."""
        ...

    async def call(self, fn: Callable[[], T]) -> T:
        """Run `fn` where the trainer's calls run, never halfway through a step."""
        ...

    async def aclose(self) -> None:
        """Release the other ranks and the thread."""
        ...


class TrainerThread:
    """Every trainer call on one thread; several ranks through `Leader`."""

    def __init__(self, trainer: TrainerBackend, cpus: list[int] | None = None) -> None:
        self.leader = Leader(trainer) if trainer.world_size > 1 else None
        self.backend: TrainerBackend = self.leader or trainer
        self.steps_run = 0
        self.cpus = cpus
        self._thread = ThreadPoolExecutor(1, "rollflow-trainer", initializer=self._bind)

    def _bind(self) -> None:
        if self.cpus and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, self.cpus)  # 0: the calling thread

    async def step(self, batch: TrainBatch) -> dict[str, float]:
        def step() -> dict[str, float]:
            out = self.backend.step(batch)
            self.steps_run = batch.step + 1  # next to the weights: a concurrent read sees both or neither
            return out

        return await self.call(step)

    async def call(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn)

    async def aclose(self) -> None:
        if self.leader is not None:
            await self.call(self.leader.stop)  # after any step still running: collectives stay in order
        self._thread.shutdown(wait=False)
