"""The fake trainer, the null weight transport and the one fake tokenizer (see `rollflow.testing`)."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from rollflow.records import TrainBatch
from rollflow.trainer import MicroBatch
from rollflow.weight_sync import Run, in_thread
from rollflow.weight_sync.buckets import BucketPlan


class FakeTrainer:
    """A `TrainerBackend` without a model: records each batch and takes `step_s` seconds per
    step (in the caller's thread, as a real step would). It has no weights to send."""

    world_size = 1

    def __init__(self, step_s: float = 0.0) -> None:
        self.step_s = step_s
        self.batches: list[TrainBatch] = []
        self.micro_batches: list[MicroBatch] = []
        self.resumed_at: int | None = None
        """The step count a checkpoint restored (None: not restored)."""

    def step(self, batch: TrainBatch) -> dict[str, float]:
        began = time.monotonic()
        if self.step_s:
            # Stands for the compute of a real step: it runs in the controller's trainer thread.
            time.sleep(self.step_s)
        self.batches.append(batch)
        tokens = sum(sum(s.loss_mask) for s in batch.samples)
        self.micro_batches = [(began, time.monotonic(), len(batch.samples), tokens)]
        return {"ratio_mean": 1.0, "loss": 0.0}

    def weight_specs(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        return []

    def full_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(())

    def adapter_weights(self) -> dict[str, torch.Tensor]:
        return {}

    def adapter_config(self) -> dict[str, Any]:
        return {}

    def save(self, path: Path) -> dict[str, Any]:
        path.mkdir(parents=True, exist_ok=True)
        return {"steps": len(self.batches)}

    def load(self, path: Path, rest: dict[str, Any]) -> None:
        if not path.is_dir():
            raise FileNotFoundError(path)
        self.resumed_at = int(rest["steps"])


class NullTransport:
    """A `WeightTransport` that moves nothing: the fake engine's weights are its version."""

    name = "null"
    snapshots = True

    def worker_call(self, plan: Any) -> None:
        """None: no single worker call loads these weights (`load` does)."""
        return None

    async def connect(self, engine: object) -> None:
        return None

    async def stage(self, plan: BucketPlan, tensors: Iterable[tuple[str, torch.Tensor]], run: Run = in_thread) -> int:
        def drain() -> int:
            for _ in tensors:  # the trainer may gather while yielding; let it finish
                pass
            return 0

        return await run(drain)

    async def load(self, engine: object, plan: BucketPlan) -> None:
        return None

    async def aclose(self) -> None:
        return None


class FakeTokenizer:
    """A tokenizer's two calls rollflow makes, without a vocabulary.

    Encoding: one token per character (`ord(c) % 997 + 1`), or, with `prompt_tokens`, exactly
    that many tokens derived from the text (fixed-length prompts for the simulator). Decoding:
    a digit for every token id divisible by 3, `x` otherwise, so the `digits` reward varies.
    """

    chat_template = "role: content per message"
    """Present, as on a chat model (only its presence is checked)."""

    def __init__(self, prompt_tokens: int | None = None) -> None:
        self.prompt_tokens = prompt_tokens

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True, tokenize: bool = True
    ) -> list[int]:
        if self.prompt_tokens is None:
            return [ord(c) % 997 + 1 for m in messages for c in m["content"]]
        seed = sum(ord(c) for m in messages for c in m["content"])
        return [1 + (seed + i * 7919) % 997 for i in range(self.prompt_tokens)]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(str(i % 10) if i % 3 == 0 else "x" for i in ids)
