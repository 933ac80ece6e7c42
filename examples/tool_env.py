"""Multi-turn episodes: train the tiny model in the calculator tool environment, or in the
answer-and-retry environment.

    bin/dev python examples/tool_env.py            # calculator tool
    bin/dev python examples/tool_env.py retry      # no tools: "That is not right. Try again."

Every sample is an episode of up to `env.max_turns` model turns. The model's tokens are trained
(loss mask 1) with their per-token versions; tool results and replies are tokenised from the chat
template and masked out. The environment's rewards are the only reward (part `env`), and each
turn's reward is also a process reward (`scoring.process_coef` credits it to the turn's tokens).

The tiny model has random weights: it almost never writes a well-formed tool call, so calculator
episodes mostly end after one turn, and retry episodes run to the turn limit. The printout shows
the mechanics (turns, tool calls, the reward), not a skill.
"""

from __future__ import annotations

import asyncio
import sys

import rollflow
from rollflow.envs.calculator import CalculatorEnv, calculator

TOOL_CALLS = 0


class CountingCalculator(CalculatorEnv):
    """The built-in calculator environment, counting the tool calls the model makes."""

    async def step(self, turn: rollflow.Turn) -> rollflow.EnvStep:
        global TOOL_CALLS
        before = self.tool_calls
        result = await super().step(turn)
        TOOL_CALLS += self.tool_calls - before
        return result


async def main(name: str) -> None:
    config = rollflow.load_config(
        preset="tiny",
        overrides=[
            "run.max_steps=6",
            "env.kind=tool",
            f"env.name={name}",
            "env.max_turns=3",
            "env.max_tokens=96",
            "scoring.process_coef=0.5",
        ],
    )
    env = None  # `retry`: the built-in, by name
    if name == "calculator":
        env = lambda: CountingCalculator(tools={"calculator": calculator}, tool_timeout_s=2.0)  # noqa: E731
    output_dir = rollflow.new_run_dir(f"env-{name}")  # runs/env-<name>-<date>-<time>, new each time
    result = await rollflow.train(config, output_dir, env=env)
    for row in result.metrics:
        reward, turns = row["reward_mean"], row["turns_mean"]
        print(f"step {row['step']}: reward {reward:.3f}  turns {turns:.2f}  tokens {row['tokens']}")
    if name == "calculator":
        print(f"tool calls written by the model: {TOOL_CALLS}")
    print(f"the run is in {output_dir}")


if __name__ == "__main__":  # vLLM spawns processes: keep the guard
    asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else "calculator"))
