"""Train an environment class written for TRL's `GRPOTrainer(environment_factory=...)`, as it is.

    bin/dev python examples/factory_env.py

`SubmitEnv` (examples/environments/trl_envs.py) gets each arithmetic prompt's row in `reset`,
offers the model a `submit` tool (described to the chat template from its docstring) and scores
the episode with its own `get_reward`: 1.0 when the submitted number is the answer. A reward
function with TRL's signature reads the episode's instance (`environments=`). The tiny model has
random weights and rarely writes a tool call: the printout shows the mechanics, not a skill.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import rollflow

HERE = Path(__file__).parent


def tried(prompts, completions, environments, **kwargs):
    """1.0 for an episode in which the model submitted anything (TRL's signature)."""
    return [float(env.submitted is not None) for env in environments]


async def main() -> None:
    sys.path.insert(0, str(HERE / "environments"))  # where these examples' environments live
    from trl_envs import SubmitEnv

    config = rollflow.load_config(
        preset="tiny",
        overrides=["env.kind=factory", "env.max_turns=2", "env.max_tokens=96", "run.max_steps=6",
                   'scoring.rewards=[{name = "tried", weight = 0.1}]', "observe.sinks=[]"],
    )
    output_dir = rollflow.new_run_dir("factory")  # runs/factory-<date>-<time>, new each time
    result = await rollflow.train(config, output_dir, environment_factory=SubmitEnv, reward_funcs={"tried": tried})
    for row in result.metrics:
        parts = ", ".join(f"{name} {value['mean']:.3f}" for name, value in row["rewards"].items())
        print(f"step {row['step']}: reward {row['reward_mean']:.3f} ({parts}), turns {row['turns_mean']:.2f}")
    print(f"{result.steps} steps, {result.trained_prompts} prompts trained, dropped {result.dropped}; in {output_dir}")


if __name__ == "__main__":  # vLLM spawns processes: keep the guard
    asyncio.run(main())
