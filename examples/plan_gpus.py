"""Size a GPU setup with the simulator before renting it: which max_lag, how many engines?

    bin/dev python examples/plan_gpus.py

Runs the real controller on virtual time against the 7B/H100 profile (rollflow.sim.profiles)
for max_lag 0, 1 and 2 with 1, 2 and 4 inference GPUs, and prints steps/hour and idle time.
Takes about 25 s on a laptop CPU; nothing sleeps and no GPU is needed.
"""

from __future__ import annotations

from dataclasses import replace

from rollflow.sim import Scenario, simulate
from rollflow.sim.lengths import LengthModel
from rollflow.sim.profiles import engine_profile, trainer_profile


def main() -> None:
    base = Scenario(
        engine=engine_profile("7B", "H100"),
        trainer=trainer_profile("7B"),
        lengths=LengthModel(mean=300, sigma=0.8),  # long-tailed completions, correlated per prompt
        trainer_gpus=2,
        steps=6,
        groups_per_step=16,
        group_size=8,
    )
    print(f"{'max_lag':>8}{'inference GPUs':>16}{'steps/hour':>12}{'trainer idle':>14}{'engine idle':>13}")
    for max_lag in (0, 1, 2):
        for gpus in (1, 2, 4):
            result = simulate(replace(base, max_lag=max_lag, inference_gpus=gpus))
            print(f"{max_lag:>8}{gpus:>16}{result.steps_per_hour:>12.0f}{result.trainer_idle:>14.0%}"
                  f"{result.engine_idle:>13.0%}")


if __name__ == "__main__":
    main()
