"""The bridge from the controller to trainer ranks: samples -> `TrainBatch` -> every rank.

`train_sample` turns a scored `Sample` and its advantage into what the trainer consumes.
`broadcast` sends a control message from rank 0 to all ranks over torch.distributed (msgpack
bytes in a uint8 tensor: length first, then payload); ranks other than 0 block in it waiting
for the next message. The calls are blocking: the controller runs them in a worker thread so
its event loop keeps streaming. This module does no training and no scheduling.
"""

from __future__ import annotations

import msgspec
import torch
import torch.distributed as dist

from rollflow.records import Sample, TrainBatch, TrainSample


class Step(msgspec.Struct, frozen=True, tag="step"):
    """Train on this batch."""

    batch: TrainBatch


class Sync(msgspec.Struct, frozen=True, tag="sync"):
    """Gather full weights in lockstep (rank 0 sends them to the engine)."""


class Stop(msgspec.Struct, frozen=True, tag="stop"):
    """Leave the follower loop."""


Message = Step | Sync | Stop
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def train_sample(sample: Sample, advantage: float, loss_mask: list[int] | None = None) -> TrainSample:
    """What the trainer needs from one sample (`loss_mask` overrides the sample's, e.g. to
    withhold tokens that are too stale)."""
    return TrainSample(
        input_ids=sample.prompt_token_ids + sample.completion_token_ids,
        prompt_len=len(sample.prompt_token_ids),
        logprobs=sample.logprobs,
        loss_mask=loss_mask if loss_mask is not None else sample.loss_mask,
        advantage=advantage,
        temperature=sample.sampling.temperature,
        top_k=sample.sampling.top_k,
        top_p=sample.sampling.top_p,
    )


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
