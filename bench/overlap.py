"""Overlap: the same training workload run synchronously (max_lag 0) and asynchronously, side by side.

Both runs use the tiny model on the arithmetic prompts with the `digits` reward, the same batch
and the same number of steps, with the vLLM engine bound to core 0 and the controller + trainer
to core 1 (one thread each: on 2 cores, two OpenMP threads per process slow everything down).
Steady state is measured from the end of the first step to the end of the last (engine start
and warm-up excluded). Prints wall time, trainer idle fraction (waiting for a batch) and engine
idle fraction (no request generating) for both, the speedup, and last
`RESULT overlap_speedup=<x> trainer_idle_async=<y>`.

    bin/dev python bench/overlap.py [--steps 24] [--max-tokens 64] [--groups 8] [--system-words 400] [--max-lag 2]
        [--keep DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import tempfile
from pathlib import Path

from rollflow.config import load_config
from rollflow.controller import train

ENGINE_CORE, CONTROLLER_CORE = 0, 1
SYSTEM_WORDS = " ".join(["think step by step then answer with the number"] * 40)
"""A long system prompt: training pays for every prompt token, generation prefills it once
(prefix caching shares it), which is how long prompts shift work towards the trainer."""


def pin(core: int) -> None:
    """Bind every thread of this process to one core (threads started later inherit it)."""
    if not hasattr(os, "sched_setaffinity") or (os.cpu_count() or 1) < 2:
        return
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):  # a thread that just ended
            os.sched_setaffinity(int(tid), {core})


async def one(max_lag: int, args: argparse.Namespace) -> dict[str, float]:
    config = load_config(
        preset="tiny",
        overrides=[
            f"run.max_lag={max_lag}",
            f"run.max_steps={args.steps}",
            f"run.groups_per_step={args.groups}",
            f"sampling.max_tokens={args.max_tokens}",
            f"trainer.micro_batch_tokens={args.micro_batch_tokens}",
            f"data.system_prompt='{SYSTEM_WORDS[: args.system_words]}'",
        ],
    )
    pin(ENGINE_CORE)  # the engine process spawned at start inherits this core
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(args.keep) / ("synchronous" if max_lag == 0 else "asynchronous") if args.keep else scratch
        result = await train(config, out, on_step=lambda _row: pin(CONTROLLER_CORE))
    steady = result.metrics[1:]
    first, last = result.metrics[0], result.metrics[-1]
    wall = last["wall_s"] - first["wall_s"]
    busy = last["engine_busy_s"] - first["engine_busy_s"]
    waited = sum(m["batch_wait_s"] for m in steady)
    train_s = sum(m["train_step_s"] for m in steady)
    sync_s = sum(m["weight_sync_s"] for m in steady)
    return {
        "wall_s": wall,
        "trainer_idle": waited / wall if wall > 0 else 0.0,
        "engine_idle": max(0.0, 1.0 - busy / wall) if wall > 0 else 0.0,
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
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-lag", type=int, default=2)
    parser.add_argument("--micro-batch-tokens", type=int, default=8192)
    parser.add_argument("--system-words", type=int, default=400, help="characters of a shared system prompt")
    parser.add_argument(
        "--keep", metavar="DIR", help="keep both runs' output in DIR/synchronous and DIR/asynchronous "
        "(then `python -m rollflow plot DIR/synchronous DIR/asynchronous` draws their timelines)"
    )
    args = parser.parse_args()
    # The engine process (spawned at start, while this process sits on core 0) keeps core 0 and
    # binds its OpenMP thread there; after the first step this process (controller loop and
    # trainer thread) moves to core 1.
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", str(ENGINE_CORE))
    asyncio.run(main(args))
