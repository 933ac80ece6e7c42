"""A run's state at a checkpoint: assembled from the components, and put back into them.

`snapshot` takes everything a checkpoint holds at one instant (the trainer's step, the
sampler's position, the prompts drawn, admission and accounting counters, the buffer, the
samples in flight token by token, the logs' lengths); `restore` puts a checkpoint's state back
before the engine starts (the trainer's tensors through the `Checkpointer`). `Checkpointed`
names the components they read and write. The files themselves are `rollflow.checkpoint` and
`controller.persistence`; when to checkpoint is the controller's and the `Checkpointer`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rollflow.checkpoint import RunState, rng_state, set_rng_state
from rollflow.controller.persistence import Checkpointer, Outputs
from rollflow.controller.producer import Producer
from rollflow.controller.setup import Flow
from rollflow.controller.training import TrainingLoop
from rollflow.sampler import Sampler


@dataclass(frozen=True)
class Checkpointed:
    """The components whose state a checkpoint holds."""

    flow: Flow
    sampler: Sampler
    producer: Producer
    training: TrainingLoop
    outputs: Outputs
    checkpointer: Checkpointer


def snapshot(parts: Checkpointed, step: int, wall_s: float) -> RunState:
    """The run's state after `step` steps, at this instant (no await inside: nothing changes
    while it is taken). `wall_s`: the run's wall time so far, earlier parts included."""
    flow, producer = parts.flow, parts.producer
    return RunState(
        step=step,
        wall_s=wall_s,
        trainer={},
        rng=rng_state(),
        sampler=parts.sampler.state_dict(),
        consumed=list(producer.consumed),
        group_seq=producer.group_seq,
        started=flow.admission.started,
        trained=flow.accounting.trained,
        dropped=dict(flow.accounting.dropped),
        nonfinite_streak=parts.training.nonfinite_streak,
        buffer=flow.buffer.snapshot(),
        in_flight=producer.snapshot(),
        ledger_bytes=parts.outputs.ledger.position(),
        metrics_bytes=parts.outputs.metrics.position(),
    )


async def restore(parts: Checkpointed, checkpoint: Path, state: RunState) -> None:
    """Put the trainer, sampler, admission, buffer and counters back as the checkpoint has them
    (in-flight groups are relaunched by the producer, engine weights after the engine starts)."""
    flow, producer, training = parts.flow, parts.producer, parts.training
    await parts.checkpointer.restore(checkpoint, state)
    set_rng_state(state.rng)
    parts.sampler.load_state_dict(state.sampler)
    producer.consumed = list(state.consumed)
    producer.group_seq = state.group_seq
    producer.resume_from = list(state.in_flight)
    flow.accounting.trained = state.trained
    flow.accounting.dropped = dict(state.dropped)
    training.nonfinite_streak = state.nonfinite_streak
    training.first_step = state.step
    training.wall_offset = state.wall_s
    flow.admission.started = state.started
    await flow.admission.advance(state.step)
    for group in state.buffer:
        await flow.buffer.put(group)
