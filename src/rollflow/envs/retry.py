"""The retry environment: answer, hear whether it was right, try again (multi-turn, no tools).

After each wrong answer the user says so and asks again; a right answer at turn k (0-based) ends
the episode with reward max(0, 1 − RETRY_PENALTY × k), each wrong turn earns 0. Every turn's
reward is a process reward at the end of that turn. Scored with the prompt's task verifier.
"""

from __future__ import annotations

from rollflow.envs import EnvStep, Turn
from rollflow.records import Message, Prompt
from rollflow.tasks import verify

RETRY_PENALTY = 0.25
"""Reward lost per earlier wrong turn."""

TRY_AGAIN = "That is not right. Try again."


class RetryEnv:
    """One episode of answer-and-retry."""

    def __init__(self) -> None:
        self.prompt: Prompt | None = None

    async def reset(self, prompt: Prompt) -> list[Message]:
        self.prompt = prompt
        return list(prompt.messages)

    async def step(self, turn: Turn) -> EnvStep:
        prompt = self.prompt
        assert prompt is not None, "reset() comes first"
        if verify(prompt.task, turn.text, prompt.answer, prompt.metadata) >= 1.0:
            return EnvStep(reward=max(0.0, 1.0 - RETRY_PENALTY * turn.index), done=True)
        return EnvStep(reward=0.0, messages=[Message(role="user", content=TRY_AGAIN)])
