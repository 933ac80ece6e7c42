"""Train a verifiers v1 taskset as it is: typed tasks that score themselves (verifiers 0.3+).

    bin/dev python examples/verifiers_taskset.py

`sums-taskset` (examples/environments/sums_taskset.py) yields "What is a + b?" tasks; each task
scores a reply with its own `@vf.reward`s (`correct`, weight 1; `digits`, weight 0.5) and a
`@vf.metric` (`reply_chars`). rollflow loads the taskset with verifiers' own loader, generates each
reply, records it as the episode's `vf.Trace` and lets the task score it: the weighted sum is the
reward, and each reward's score and the metric are printed per step (`env_metrics`).

On the tiny preset the model has random weights: the printout shows the mechanics, and the
digit-share reward gives it something to climb.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import rollflow

HERE = Path(__file__).resolve().parent


def show(m: dict) -> None:
    measured = "  ".join(f"{k} {v:.2f}" for k, v in sorted(m["env_metrics"].items()))
    print(f"step {m['step'] + 1}: reward {m['reward_mean']:.3f}  {measured}  unscorable {m['unscorable']}")


async def main() -> None:
    sys.path.insert(0, str(HERE / "environments"))  # where these examples' tasksets live
    config = rollflow.load_config(
        preset="tiny",
        overrides=["env.kind=verifiers", "env.taskset=sums-taskset", "env.taskset_args={n = 32}", "run.max_steps=8",
                   "sampling.max_tokens=16", "observe.sinks=[]"],
    )
    output_dir = rollflow.new_run_dir("verifiers-taskset")  # new each time
    result = await rollflow.train(config, output_dir, on_step=show)
    print(f"{result.steps} steps, {result.trained_prompts} prompts trained, dropped {result.dropped}; in {output_dir}")


if __name__ == "__main__":  # vLLM spawns processes: keep the guard
    asyncio.run(main())
