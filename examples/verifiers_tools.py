"""Train a verifiers v1 taskset whose tasks bring tools (a `vf.Toolset`), as it is.

    bin/dev python examples/verifiers_tools.py

`calc-taskset` (examples/environments/calc_taskset.py) yields "What is a × b + c?" tasks; each
task launches a `Calculator` toolset (`calculator_add`, `calculator_multiply`). verifiers would run
it as an MCP server program beside a harness program; rollflow registers it on an in-process MCP
server, shows its tools to the chat template, runs the model's `<tool_call>`s and returns their
results as tool messages, then lets the task score the whole trace: `correct` (weight 1),
`used_tools` (weight 0.25) and the `tool_calls` metric, printed per step.

On the tiny preset the model has random weights and almost never calls a tool: the printout shows
the mechanics (every episode scored by its task), not learning.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import rollflow

HERE = Path(__file__).resolve().parent


def show(m: dict) -> None:
    measured = "  ".join(f"{k} {v:.2f}" for k, v in sorted(m["env_metrics"].items()))
    print(f"step {m['step'] + 1}: reward {m['reward_mean']:.3f}  turns {m['turns_mean']:.2f}  {measured}  "
          f"unscorable {m['unscorable']}")


async def main() -> None:
    sys.path.insert(0, str(HERE / "environments"))  # where these examples' tasksets live
    config = rollflow.load_config(
        preset="tiny",
        overrides=["env.kind=verifiers", "env.taskset=calc-taskset", "env.taskset_args={n = 32}", "run.max_steps=6",
                   "sampling.max_tokens=24", "env.max_turns=3", "env.max_tokens=96", "observe.sinks=[]"],
    )
    output_dir = rollflow.new_run_dir("verifiers-tools")  # new each time
    result = await rollflow.train(config, output_dir, on_step=show)
    print(f"{result.steps} steps, {result.trained_prompts} prompts trained, dropped {result.dropped}; in {output_dir}")


if __name__ == "__main__":  # vLLM spawns processes: keep the guard
    asyncio.run(main())
