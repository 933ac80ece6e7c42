"""Run under torchrun by test_trainer_ranks.py: one FSDP2 trainer step across gloo ranks.

argv: BATCH_FILE OUT_DIR LORA(0|1) [checkpoint]. Rank 0 reads the batch and hands it to the other
ranks with rollflow's handoff broadcast; every rank steps; rank 0 writes gradients, weights,
metrics. With `checkpoint`: every rank saves its shard after the step, a second trainer loads
it, both step again, and rank 0 writes whether their weights agree.
"""

import json
import sys
from pathlib import Path

import msgspec
import torch
import torch.distributed as dist

from rollflow.config import LoRAConfig, TrainerConfig
from rollflow.models import tiny_model_path
from rollflow.ranks import Step, broadcast
from rollflow.records import TrainBatch
from rollflow.trainer import Trainer


def main() -> None:
    batch_file, out_dir, lora = sys.argv[1], Path(sys.argv[2]), sys.argv[3] == "1"
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    message = None
    if rank == 0:
        message = Step(batch=msgspec.msgpack.decode(Path(batch_file).read_bytes(), type=TrainBatch))
    received = broadcast(message)
    assert isinstance(received, Step)
    config = TrainerConfig(lr=1e-3, micro_batch_tokens=40, lora=LoRAConfig(enabled=lora, rank=4))
    trainer = Trainer(tiny_model_path(0), config)
    trainer.accumulate(received.batch)
    grads = trainer.gradients()
    trainer.optimizer.zero_grad(set_to_none=True)
    metrics = trainer.step(received.batch)
    if sys.argv[4:] == ["checkpoint"]:
        rest = trainer.save(out_dir / "checkpoint")  # each rank writes its shard
        saved = dict(trainer.full_weights())
        if rank == 0:
            torch.save(saved, out_dir / "saved.pt")
        restored = Trainer(tiny_model_path(0), config)
        restored.load(out_dir / "checkpoint", rest)
        trainer.step(received.batch)
        restored.step(received.batch)  # equal only if weights and AdamW moments came back
        a, b = dict(trainer.full_weights()), dict(restored.full_weights())
        if rank == 0:
            diff = max((a[k] - b[k]).abs().max().item() for k in a)
            (out_dir / "checkpoint.json").write_text(json.dumps({"max_diff": diff, "steps": restored.steps}))
        dist.barrier()
        dist.destroy_process_group()
        return
    weights = dict(trainer.full_weights())
    if rank == 0:
        torch.save({"grads": grads, "weights": weights}, out_dir / "result.pt")
        (out_dir / "metrics.json").write_text(json.dumps(metrics))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
