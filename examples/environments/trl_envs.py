"""Environment classes written for TRL's `GRPOTrainer(environment_factory=...)`, unchanged.

`SubmitEnv` checks an arithmetic answer the model submits through its `submit` tool (the row's
`answer` column reaches `reset`); `CounterEnv` asks the model to bring a counter to a target
with its `increment` tool. Each owns its reward (`get_reward`). rollflow trains them with
`[env] kind = "factory"`, `factory = "trl_envs:SubmitEnv"` (this folder on sys.path, as an
installed package would be), or `rollflow.train(..., environment_factory=SubmitEnv)`;
examples/factory_env.py does.
"""

from __future__ import annotations


class SubmitEnv:
    def reset(self, answer: str | None = None, **kwargs) -> str | None:
        self.answer = answer
        self.submitted: int | None = None
        return " Submit the result with the submit tool."

    def get_reward(self) -> float:
        return float(self.submitted is not None and str(self.submitted) == self.answer)

    def submit(self, answer: int) -> str:
        """Submit the final answer.

        Args:
            answer: The result of the computation.

        Returns:
            A confirmation.
        """
        self.submitted = answer
        return "Submitted."


class CounterEnv:
    def reset(self, target: int = 3, **kwargs) -> str:
        self.counter = 0
        self.target = int(target)
        return f" Bring the counter to {self.target} with the increment tool."

    async def get_reward(self) -> float:
        return float(self.counter == self.target)

    def increment(self, step: int) -> int:
        """Add to the counter.

        Args:
            step: The value to add.

        Returns:
            The counter after the addition.
        """
        self.counter += step
        return self.counter
