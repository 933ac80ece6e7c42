"""Train the tiny model with your own reward functions (TRL signature), one sync, one async.

    bin/dev python examples/custom_reward.py

`brevity` prefers short completions; `has_digit` is async (as a call to a judge would be) and
returns None — unscorable, left out of the group's baseline — for an empty completion. Their
weighted sum is the reward. The per-function means are in metrics.jsonl under `rewards`.
"""

from __future__ import annotations

import asyncio

import rollflow


def brevity(prompts: list[str], completions: list[str], **kwargs) -> list[float | None]:
    return [1.0 - min(len(text), 64) / 64 for text in completions]


async def has_digit(prompts: list[str], completions: list[str], **kwargs) -> list[float | None]:
    await asyncio.sleep(0)  # stands for a remote judge
    return [None if not text else float(any(c.isdigit() for c in text)) for text in completions]


async def main() -> None:
    config = rollflow.load_config(
        preset="tiny",
        overrides=[
            "run.max_steps=8",
            # Weights (and timeouts) for the functions passed below, by name.
            'scoring.rewards=[{name="brevity", weight=0.5}, {name="has_digit", weight=1.0, timeout_s=5}]',
        ],
    )
    output_dir = rollflow.new_run_dir("custom_reward")  # runs/custom_reward-<date>-<time>, new each time
    result = await rollflow.train(config, output_dir, reward_funcs={"brevity": brevity, "has_digit": has_digit})
    for row in result.metrics:
        parts = ", ".join(f"{name} {value['mean']:.3f}" for name, value in row["rewards"].items())
        print(f"step {row['step']}: reward {row['reward_mean']:.3f} ({parts}), unscorable {row['unscorable']}")
    print(f"the run is in {output_dir}")


if __name__ == "__main__":  # vLLM spawns processes: keep the guard
    asyncio.run(main())
