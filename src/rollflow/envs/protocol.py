"""The multi-turn seam: an `Environment` answers the model's turns, one per episode.

An `Environment` is made fresh for every episode (its state is the episode's). `reset(prompt)`
gives the opening messages; `step(turn)` gets the model's turn (`Turn`) and returns what the
environment says next (a tool result, a user reply), that turn's reward and whether the episode
is over (`EnvStep`). This module holds the types only; `rollflow.envs.episode` plays episodes,
and the seam every source of episodes shares is `rollflow.episodes`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol, runtime_checkable

import msgspec

from rollflow.records import Message, Prompt


class Turn(msgspec.Struct, frozen=True, kw_only=True):
    """One model turn as the environment sees it."""

    text: str
    """The turn's text, special tokens left out."""
    finish_reason: str
    """`stop` (the model ended its turn) or `length` (it ran out of tokens)."""
    index: int
    """0 for the first turn."""


class EnvStep(msgspec.Struct, frozen=True, kw_only=True):
    """The environment's answer to one turn."""

    messages: list[Message] = []
    """What comes next in the conversation (role `tool` for tool results, `user` for replies)."""
    reward: float | None = None
    """This turn's reward, if it earns one (the episode's reward is the sum)."""
    done: bool = False


@runtime_checkable
class Environment(Protocol):
    """One episode's environment."""

    async def reset(self, prompt: Prompt) -> list[Message]:
        """The opening messages (the prompt's own, possibly with a system message added)."""
        ...

    async def step(self, turn: Turn) -> EnvStep:
        """React to the model's turn."""
        ...


EnvFactory = Callable[[], Environment | Awaitable[Environment]]
"""Makes one environment per episode (`open_environment` calls it)."""
