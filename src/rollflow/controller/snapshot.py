"""A run's state at a checkpoint: assembled from the components, and put back into them.

Mixed into `Controller` (which provides what is declared here): `_snapshot` takes everything a
checkpoint holds at one instant (the trainer's step, the sampler's position, the prompts drawn,
admission and accounting counters, the buffer, the samples in flight token by token, the logs'
lengths); `_checkpoint` writes it through the `Checkpointer`, holding the work in progress when
the run is stopping; `_restore` puts a checkpoint's state back before the engine starts. The
files themselves are `rollflow.checkpoint` and `controller.persistence`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from rollflow.buffer import Admission, GroupBuffer
from rollflow.checkpoint import RunState, rng_state, set_rng_state
from rollflow.controller.accounting import Accounting
from rollflow.controller.persistence import Checkpointer, Outputs
from rollflow.controller.producer import Producer
from rollflow.controller.setup import Components
from rollflow.controller.training import TrainingLoop


class Snapshots:
    """Checkpoint assembly, mixed into `Controller`."""

    admission: Admission
    buffer: GroupBuffer
    parts: Components
    accounting: Accounting
    producer: Producer
    checkpointer: Checkpointer
    training: TrainingLoop
    outputs: Outputs
    clock: Callable[[], float]
    began: float

    def _settle(self) -> None:
        raise NotImplementedError

    def _snapshot(self, step: int) -> RunState:
        """The run's state at this instant (no await inside: nothing changes while it is taken)."""
        return RunState(
            step=step,
            wall_s=self.clock() - self.began + self.training.wall_offset,
            trainer={},
            rng=rng_state(),
            sampler=self.parts.sampler.state_dict(),
            consumed=list(self.producer.consumed),
            group_seq=self.producer.group_seq,
            started=self.admission.started,
            trained=self.accounting.trained,
            dropped=dict(self.accounting.dropped),
            nonfinite_streak=self.training.nonfinite_streak,
            buffer=self.buffer.snapshot(),
            in_flight=self.producer.snapshot(),
            ledger_bytes=self.outputs.ledger.position(),
            metrics_bytes=self.outputs.metrics.position(),
        )

    async def _final_checkpoint(self, step: int) -> Path:
        self._settle()  # the final checkpoint holds no work in progress
        return await self._checkpoint(step, keep_pending=False)

    async def _checkpoint(self, step: int, *, keep_pending: bool) -> Path:
        """A checkpoint after `step` steps. `keep_pending`: the run is stopping; its buffered and
        in-flight work is saved, then cancelled without being dropped."""
        self.outputs.waiting(f"writing the checkpoint of step {step}")
        state = self._snapshot(step)
        if keep_pending:
            self.accounting.hold_pending()
            await self.admission.close()
            self.producer.cancel()
        return await self.checkpointer.save(state)

    async def _restore(self, checkpoint: Path, state: RunState) -> None:
        """Put the trainer, sampler, admission, buffer and counters back as the checkpoint has them
        (in-flight groups are relaunched by the producer, engine weights after the engine starts)."""
        await self.checkpointer.restore(checkpoint, state)
        set_rng_state(state.rng)
        self.parts.sampler.load_state_dict(state.sampler)
        self.producer.consumed = list(state.consumed)
        self.producer.group_seq = state.group_seq
        self.producer.resume_from = list(state.in_flight)
        self.accounting.trained = state.trained
        self.accounting.dropped = dict(state.dropped)
        self.training.nonfinite_streak = state.nonfinite_streak
        self.training.first_step = state.step
        self.training.wall_offset = state.wall_s
        self.admission.started = state.started
        await self.admission.advance(state.step)
        for group in state.buffer:
            await self.buffer.put(group)
