"""Train a verifiers environment as it is: prime-rl's standard, through rollflow's OpenAI endpoint.

    bin/dev python examples/verifiers_env.py            # vf-sums: one turn, a rubric
    bin/dev python examples/verifiers_env.py vf-calc    # ToolEnv with an `add` tool, several turns

The environments in examples/environments/ are ordinary verifiers environments (a dataset, a
parser, a rubric; `load_environment()` builds them), loaded by name with verifiers' own loader
as an installed one would be. rollflow takes the prompts from the environment's dataset and runs
every episode as the environment's own rollout against an OpenAI-compatible endpoint that it
serves from its engine, recording each reply token with its log-prob and the version of the
weights that computed it; the rubric's score is the episode's reward.

On the tiny preset the model has random weights: the printout shows the mechanics (rewards from
the rubric, turns per episode), and the rubric's digit-share term gives it something to climb.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import rollflow

HERE = Path(__file__).resolve().parent


async def main(env_id: str) -> None:
    sys.path.insert(0, str(HERE / "environments"))  # where these examples' environments live
    config = rollflow.load_config(
        preset="tiny",
        overrides=["env.kind=verifiers", f"env.environment={env_id}", "env.max_tokens=96", "run.max_steps=8",
                   "observe.sinks=[]"],
    )
    output_dir = rollflow.new_run_dir(f"verifiers-{env_id}")  # new each time
    result = await rollflow.train(config, output_dir, on_step=lambda m: print(
        f"step {m['step'] + 1}: reward {m['reward_mean']:.3f}  turns {m['turns_mean']:.2f}  "
        f"unscorable {m['unscorable']}"
    ))
    print(f"{result.steps} steps, {result.trained_prompts} prompts trained, dropped {result.dropped}; in {output_dir}")


if __name__ == "__main__":  # vLLM spawns processes: keep the guard
    asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else "vf-sums"))
