"""Train the tiny model for a few steps from your own event loop, then read the results.

    bin/dev python examples/train_tiny.py

The tiny preset's `digits` reward (the fraction of digit characters) is something a random
model can learn; the reward per step rises within about 20 steps (about 30 s on a laptop CPU).
"""

from __future__ import annotations

import asyncio
import tempfile

import rollflow


async def main() -> None:
    config = rollflow.load_config(preset="tiny", overrides=["run.max_steps=12", "run.max_lag=1"])
    with tempfile.TemporaryDirectory() as out:
        result = await rollflow.train(config, out)
    rewards = [round(m["reward_mean"], 3) for m in result.metrics]
    print(f"reward per step: {rewards}")
    print(f"trained prompts: {result.trained_prompts}, dropped: {result.dropped}")
    print(f"largest lag of a token in the loss: {max(m['loss_lag_max'] for m in result.metrics)}")


if __name__ == "__main__":  # vLLM spawns processes: keep the guard
    asyncio.run(main())
