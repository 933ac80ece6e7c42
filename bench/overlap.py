"""Overlap: the same training workload run synchronously (max_lag 0) and asynchronously, side by side.

Both runs use the tiny model on the arithmetic prompts with the `digits` reward, the same batch
and the same number of steps, with the vLLM engine bound to core 0 and the controller + trainer
to core 1 (one thread each: on 2 cores, two OpenMP threads per process slow everything down).
Steady state is measured from the end of the first step to the end of the last (engine start
and warm-up excluded). Prints wall time, trainer idle fraction (waiting for a batch) and engine
idle fraction (no request generating) for both, the speedup, and last
`RESULT overlap_speedup=<x> trainer_idle_async=<y>`.

    bin/dev python bench/overlap.py [--steps 12] [--max-tokens 96] [--groups 4] [--max-lag 1]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile

from rollflow.config import load_config
from rollflow.controller import train


async def one(max_lag: int, args: argparse.Namespace) -> dict[str, float]:
    config = load_config(
        preset="tiny",
        overrides=[
            f"run.max_lag={max_lag}",
            f"run.max_steps={args.steps}",
            f"run.groups_per_step={args.groups}",
            f"sampling.max_tokens={args.max_tokens}",
            f"trainer.micro_batch_tokens={args.micro_batch_tokens}",
        ],
    )
    with tempfile.TemporaryDirectory() as out:
        result = await train(config, out)
    steady = result.metrics[1:]
    wall = result.metrics[-1]["wall_s"] - result.metrics[0]["wall_s"]
    waited = sum(m["batch_wait_s"] for m in steady)
    train_s = sum(m["train_step_s"] for m in steady)
    sync_s = sum(m["weight_sync_s"] for m in steady)
    return {
        "wall_s": wall,
        "trainer_idle": waited / wall if wall > 0 else 0.0,
        "engine_idle": max(0.0, 1.0 - result.engine_busy_s / result.wall_s),
        "train_s": train_s,
        "sync_s": sync_s,
        "reward_last": result.metrics[-1]["reward_mean"],
        "lag_mean": sum(m["lag_mean"] for m in steady) / len(steady),
    }


async def main(args: argparse.Namespace) -> None:
    rows = {}
    for name, lag in (("synchronous (max_lag 0)", 0), (f"asynchronous (max_lag {args.max_lag})", args.max_lag)):
        rows[name] = await one(lag, args)
    print(f"steps={args.steps} groups/step={args.groups} group_size=4 max_tokens={args.max_tokens} model=tiny")
    print(f"{'mode':<26}{'wall s':>8}{'trainer idle':>14}{'engine idle':>13}{'train s':>9}{'sync s':>8}{'lag':>6}")
    for name, r in rows.items():
        print(f"{name:<26}{r['wall_s']:>8.2f}{r['trainer_idle']:>14.1%}{r['engine_idle']:>13.1%}"
              f"{r['train_s']:>9.2f}{r['sync_s']:>8.2f}{r['lag_mean']:>6.2f}")
    sync, asyn = rows["synchronous (max_lag 0)"], rows[f"asynchronous (max_lag {args.max_lag})"]
    speedup = sync["wall_s"] / asyn["wall_s"]
    print(f"RESULT overlap_speedup={speedup:.2f} trainer_idle_async={asyn['trainer_idle']:.3f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--max-lag", type=int, default=1)
    parser.add_argument("--micro-batch-tokens", type=int, default=4096)
    args = parser.parse_args()
    # The engine process (spawned at start) binds its OpenMP thread to core 0; this process and
    # the trainer thread it starts stay on core 1.
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")
    if hasattr(os, "sched_setaffinity") and os.cpu_count() and os.cpu_count() >= 2:
        os.sched_setaffinity(0, {1})
    asyncio.run(main(args))
