"""The trainer side: one rank's model, optimizer and step, and the contract the controller uses.

`Trainer` (`rollflow.trainer.model`) is the real one: plain torch, FSDP2 across ranks, LoRA
through peft. `TrainerBackend` is what the controller calls on a trainer (always from one
dedicated thread, never the event loop); `rollflow.testing.FakeTrainer` honours it without a
model. This package does not decide what to train on and does not talk to the engine.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import torch

from rollflow.records import TrainBatch
from rollflow.trainer.batches import PolicyHead, plan_micro_batches, plan_shards
from rollflow.trainer.model import Trainer

MicroBatch = tuple[float, float, int, int]
"""(start, end, samples, tokens) of one micro-batch pass (monotonic seconds)."""


class TrainerBackend(Protocol):
    """What the controller calls on rank 0's trainer. Every call is blocking; with several ranks
    each one is collective (`rollflow.ranks.Leader` tells the other ranks first)."""

    @property
    def world_size(self) -> int:
        """Trainer ranks taking each step together (1: no torch.distributed)."""
        ...

    @property
    def micro_batches(self) -> list[MicroBatch]:
        """The last step's micro-batches (for the timeline)."""
        ...

    def step(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer step on the whole batch; returns its metrics (`skipped` = 1.0 when a
        non-finite loss or gradient left the weights unchanged)."""
        ...

    def weight_specs(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """(name, dtype, whole shape) of every weight `full_weights` yields (no gathering)."""
        ...

    def full_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every weight, whole, in the engine's (Hugging Face) naming; LoRA merged in."""
        ...

    def adapter_weights(self) -> dict[str, torch.Tensor]:
        """The LoRA adapter tensors (peft naming), whole."""
        ...

    def adapter_config(self) -> dict[str, Any]:
        """The peft adapter config as JSON-ready data."""
        ...

    def save(self, path: Path) -> dict[str, Any]:
        """Write model and optimizer tensors into the folder `path`; return the rest of the state."""
        ...

    def load(self, path: Path, rest: dict[str, Any]) -> None:
        """Restore what `save` wrote."""
        ...


__all__ = ["MicroBatch", "PolicyHead", "Trainer", "TrainerBackend", "plan_micro_batches", "plan_shards"]
