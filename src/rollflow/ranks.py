"""Several trainer ranks under torchrun: rank 0 runs the controller, the others follow it.

`python -m rollflow train ...` run by `torchrun --nproc-per-node N` (or `--nnodes`) starts one
process per rank. Every rank joins the default process group (NCCL on GPU, gloo on CPU) and
builds its `Trainer` shard (FSDP2); rank 0 also runs the controller and the engine, and sends
each batch and each weight gather to the others over that group (`rollflow.handoff`); ranks
other than 0 loop in `controller.follow` until rank 0 says stop. Without torchrun (no
WORLD_SIZE, or 1) nothing here happens. This module does not train or generate itself.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from datetime import timedelta

HANDOFF_TIMEOUT = timedelta(minutes=30)
"""How long a rank waits in a collective (a batch may take minutes to generate on CPU)."""


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def main_or_follow(run_controller: Callable[[], int], args: argparse.Namespace) -> int:
    """Run the controller on rank 0 and the follower loop elsewhere; returns the exit code."""
    if world_size() <= 1:
        return run_controller()
    import torch
    import torch.distributed as dist

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
    import torch

    from rollflow.config import load_config
    from rollflow.controller import follow
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
