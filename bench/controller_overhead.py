"""Controller overhead: samples per second through sampler -> rollout -> scoring -> buffer.

A zero-latency engine (a fixed completion per request, returned at once) and a fake
trainer (returns at once) isolate the controller's own cost per sample: admission, prompt
tokenising, one rollout coroutine per sample, reward, group advantages, buffering, batching,
ledger and metrics lines. Prints a table and, last, `RESULT controller_samples_per_s=<x>`.

    bin/dev python bench/controller_overhead.py [--steps 200] [--groups 16] [--group-size 8] [--tokens 8]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time

import machine
from sidebyside import InstantEngine

from rollflow.config import load_config
from rollflow.controller import Controller
from rollflow.controller.setup import Given
from rollflow.testing import FakeTokenizer, FakeTrainer, NullTransport


async def main(args: argparse.Namespace) -> None:
    config = load_config(
        preset="tiny",
        overrides=[
            f"run.max_steps={args.steps}",
            f"run.groups_per_step={args.groups}",
            f"rollout.group_size={args.group_size}",
            f"sampling.max_tokens={args.tokens}",
            "run.max_lag=2",
        ],
    )
    with tempfile.TemporaryDirectory() as out:
        controller = Controller(
            config,
            out,
            given=Given(
                engine=InstantEngine(args.tokens),
                trainer=FakeTrainer(),
                transport=NullTransport(),
                tokenizer=FakeTokenizer(),
            ),
        )
        import logging

        logging.disable(logging.WARNING)
        began = time.perf_counter()
        result = await controller.run()
        seconds = time.perf_counter() - began
    # Steady state: from the end of the first step to the end of the last (start-up excluded).
    steady_s = result.metrics[-1]["wall_s"] - result.metrics[0]["wall_s"]
    steady = (result.steps - 1) * args.groups * args.group_size
    samples = result.steps * args.groups * args.group_size
    print(f"{'':<14}{'steps':>6}{'samples':>10}{'seconds':>10}{'samples/s':>12}")
    print(f"{'whole run':<14}{result.steps:>6}{samples:>10}{seconds:>10.2f}{samples / seconds:>12.0f}")
    print(f"{'steady state':<14}{result.steps - 1:>6}{steady:>10}{steady_s:>10.2f}{steady / steady_s:>12.0f}")
    print(f"tokens/sample={args.tokens} group_size={args.group_size} groups/step={args.groups}")
    print(machine.describe())
    print(f"RESULT controller_samples_per_s={steady / steady_s:.0f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=8)
    asyncio.run(main(parser.parse_args()))
