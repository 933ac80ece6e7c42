"""Several trainer ranks under torchrun: rank 0 leads, the others follow; the whole protocol.

`python -m rollflow train ...` run by `torchrun --nproc-per-node N` (or `--nnodes`) starts one
process per rank. Every rank joins the default process group (NCCL on GPU, gloo on CPU) and
builds its `Trainer` shard (FSDP2); rank 0 also runs the controller and the engine.

Every trainer call that is collective under FSDP2 (a step, a weight gather, a checkpoint save or
load) must be made by all ranks together. Rank 0 wraps its trainer in a `Leader`, which sends
the matching message (`Step`, `Sync`, `Adapter`, `Save`, `Load`) before making the call itself;
ranks other than 0 loop in `follow`, making the same call for each message until `Stop`.
Messages travel with `broadcast` (msgpack bytes in a uint8 tensor: length first, then payload).
The calls are blocking: the controller makes them all on its one trainer thread, never on the
event loop, so they reach the other ranks in the order they are made.

When an announced call fails on rank 0, the followers may be waiting inside a collective that
rank 0 will never make: the ranks are out of step, and no further message can be matched. The
leader then sends nothing more (not even `Stop`); rank 0's error ends its process with a
non-zero exit, and the followers end with it (torchrun stops the other ranks when one fails, and
a collective whose peer has gone fails). Without torchrun (no WORLD_SIZE, or 1) nothing here
happens. This module does not decide when to train.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import msgspec
import torch
import torch.distributed as dist

from rollflow import faults
from rollflow.records import TrainBatch
from rollflow.trainer import MicroBatch, TrainerBackend

log = logging.getLogger(__name__)

HANDOFF_TIMEOUT = timedelta(minutes=30)
"""How long a rank waits in a collective (a batch may take minutes to generate on CPU)."""


class Step(msgspec.Struct, frozen=True, tag="step"):
    """Train on this batch."""

    batch: TrainBatch


class Sync(msgspec.Struct, frozen=True, tag="sync"):
    """Gather full weights in lockstep (rank 0 sends them to the engine)."""


class Adapter(msgspec.Struct, frozen=True, tag="adapter"):
    """Gather the LoRA adapter in lockstep (rank 0 sends it to the engine)."""


class Stop(msgspec.Struct, frozen=True, tag="stop"):
    """Leave the follower loop."""


class Save(msgspec.Struct, frozen=True, tag="save"):
    """Write this rank's trainer shard into the checkpoint folder `path`."""

    path: str


class Load(msgspec.Struct, frozen=True, tag="load"):
    """Restore this rank's trainer shard from the checkpoint folder `path`."""

    path: str
    rest: bytes
    """The non-tensor trainer state (msgpack)."""


Message = Step | Sync | Adapter | Stop | Save | Load
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def broadcast(message: Message | None, *, src: int = 0, group: dist.ProcessGroup | None = None) -> Message:
    """Rank `src` passes the message; every other rank passes None and receives it."""
    rank = dist.get_rank(group)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else None
    if rank == src:
        if message is None:
            raise ValueError("the source rank must pass a message")
        payload = torch.frombuffer(bytearray(_encoder.encode(message)), dtype=torch.uint8)
        size = torch.tensor([payload.numel()], dtype=torch.long)
    else:
        size = torch.zeros(1, dtype=torch.long)
    size = size.to(device) if device else size
    dist.broadcast(size, src=src, group=group)
    if rank != src:
        payload = torch.empty(int(size.item()), dtype=torch.uint8)
    buffer = payload.to(device) if device else payload
    dist.broadcast(buffer, src=src, group=group)
    if rank == src:
        return message  # type: ignore[return-value]
    return _decoder.decode(buffer.cpu().numpy().tobytes())


class Leader:
    """Rank 0's trainer with several ranks: each collective call is announced to the followers
    first, so every rank makes it together. A `TrainerBackend` itself."""

    def __init__(self, trainer: TrainerBackend) -> None:
        self.trainer = trainer
        self.world_size = trainer.world_size
        self.in_lockstep = True
        """False once an announced call failed here: the followers may be inside a collective
        this rank will never make, so nothing more is sent to them."""

    @contextmanager
    def _announce(self, message: Message) -> Iterator[None]:
        """Send `message`, then make the matching call in the body; a failure in it puts the
        ranks out of step for good."""
        if not self.in_lockstep:
            raise RuntimeError("the trainer ranks are out of step after an earlier failure")
        try:
            broadcast(message)
            yield
        except BaseException:  # GeneratorExit too: a weight gather left halfway
            self.in_lockstep = False
            raise

    @property
    def micro_batches(self) -> list[MicroBatch]:
        return self.trainer.micro_batches

    def step(self, batch: TrainBatch) -> dict[str, float]:
        with self._announce(Step(batch=batch)):
            faults.point("leader-step")
            return self.trainer.step(batch)

    def weight_specs(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        return self.trainer.weight_specs()

    def full_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        # A generator: the announcement is made by the thread that iterates, when it starts.
        with self._announce(Sync()):
            yield from self.trainer.full_weights()

    def adapter_weights(self) -> dict[str, torch.Tensor]:
        with self._announce(Adapter()):
            return self.trainer.adapter_weights()

    def adapter_config(self) -> dict[str, Any]:
        return self.trainer.adapter_config()

    def save(self, path: Path) -> dict[str, Any]:
        with self._announce(Save(path=str(path))):
            return self.trainer.save(path)

    def load(self, path: Path, rest: dict[str, Any]) -> None:
        with self._announce(Load(path=str(path), rest=msgspec.msgpack.encode(rest))):
            self.trainer.load(path, rest)

    def stop(self) -> None:
        """Release the followers (the run is over), unless the ranks are out of step."""
        if not self.in_lockstep:
            log.error("trainer ranks out of step after a failure on rank 0: the other ranks end with this process")
            return
        broadcast(Stop())


def follow(trainer: TrainerBackend) -> None:
    """The loop of trainer ranks other than 0: make each collective call rank 0 announces."""
    while True:
        message = broadcast(None)
        match message:
            case Step(batch=batch):
                trainer.step(batch)
            case Sync():
                for _ in trainer.full_weights():
                    pass
            case Adapter():
                trainer.adapter_weights()
            case Save(path=path):
                trainer.save(Path(path))
            case Load(path=path, rest=rest):
                trainer.load(Path(path), msgspec.msgpack.decode(rest))
            case Stop():
                return


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def main_or_follow(run_controller: Callable[[], int], args: argparse.Namespace) -> int:
    """Run the controller on rank 0 and the follower loop elsewhere; returns the exit code."""
    if world_size() <= 1:
        return run_controller()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=HANDOFF_TIMEOUT)
    try:
        if dist.get_rank() == 0:
            return run_controller()
        return follow_rank(args)
    finally:
        dist.destroy_process_group()


def follow_rank(args: argparse.Namespace) -> int:
    """A rank other than 0: build the same trainer shard, then follow rank 0's messages."""
    from rollflow.config import load_config
    from rollflow.models import resolve_model
    from rollflow.trainer import Trainer

    overrides = list(args.overrides)
    if args.max_steps is not None:
        overrides.append(f"run.max_steps={args.max_steps}")
    config = load_config(args.config, preset=args.preset, overrides=overrides)
    torch.set_num_threads(config.run.trainer_threads)
    trainer = Trainer(resolve_model(config.model.path), config.trainer, config.loss)
    follow(trainer)
    return 0
