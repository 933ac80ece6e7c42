"""A trainer-side weight sender in its own process, for weight-sync tests.

    python weight_sender.py slow PORT BUCKET_BYTES DELAY_S STOP_AFTER   # tiny model B, bucket by bucket
    torchrun --nproc-per-node 2 weight_sender.py fsdp PORT OUT_FILE BATCH_FILE

`slow` serves the gloo rendezvous on PORT (it prints `listening` once it does), sends the plan
and then buckets with a pause between them and goes silent after STOP_AFTER buckets, so a test
can kill or stall it mid-transfer. `fsdp` runs two FSDP2 trainer ranks that take one step; all ranks gather full
weights in lockstep and rank 0 sends them, then saves them.
"""

import sys
import time

import torch
import torch.distributed as dist

from rollflow.models import tiny_model_path
from rollflow.weight_sync import plan_for
from rollflow.weight_sync.buckets import pack, plan_buckets
from rollflow.weight_sync.gloo import GlooSender, _broadcast


def slow(port: int, bucket_bytes: int, delay: float, stop_after: int) -> None:
    from safetensors.torch import load_file

    weights = load_file(tiny_model_path(1) / "model.safetensors")
    plan = plan_buckets(((n, t.dtype, tuple(t.shape)) for n, t in weights.items()), bucket_bytes)
    sender = GlooSender("127.0.0.1", port, timeout_s=10)
    print("listening", flush=True)  # the engine may join from now on
    sender.connect()
    print(f"connected buckets={len(plan.bucket_sizes)}", flush=True)
    encoded = torch.frombuffer(bytearray(plan.encode()), dtype=torch.uint8)
    _broadcast(sender._group, torch.tensor([encoded.numel(), 0], dtype=torch.int64))  # a full sync
    _broadcast(sender._group, encoded)
    for index, buffer in pack(plan, weights.items()):
        if index == stop_after:
            break
        _broadcast(sender._group, buffer)
        print("bucket", flush=True)
        time.sleep(delay)
    time.sleep(3600)  # never finish on its own: the test kills or outwaits this process


def fsdp(port: int, out_file: str, batch_file: str) -> None:
    from pathlib import Path

    import msgspec

    from rollflow.config import TrainerConfig
    from rollflow.records import TrainBatch
    from rollflow.trainer import Trainer

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    trainer = Trainer(tiny_model_path(0), TrainerConfig(lr=5e-2))
    trainer.step(msgspec.msgpack.decode(Path(batch_file).read_bytes(), type=TrainBatch))
    specs = [(n, t.dtype, tuple(t.shape)) for n, t in trainer.lm.state_dict().items()]
    plan = plan_for(specs, bucket_bytes=256 * 1024)
    weights = list(trainer.full_weights())  # every rank gathers, in lockstep
    if rank == 0:
        sender = GlooSender("127.0.0.1", port, timeout_s=60)
        sender.connect()
        sender.send(plan, weights)
        torch.save(dict(weights), out_file)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[1] == "slow":
        slow(int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5]))
    else:
        fsdp(int(sys.argv[2]), sys.argv[3], sys.argv[4])
