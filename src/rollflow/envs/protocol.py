"""The multi-turn seam: an `Environment` answers the model's turns, one per episode.

An `Environment` is made fresh for every episode (its state is the episode's). `reset(prompt)`
gives the opening messages; `step(turn)` gets the model's turn (`Turn`) and returns what the
environment says next (a tool result, a user reply), that turn's reward and whether the episode
is over (`EnvStep`). `Served` marks a source that holds something for the whole run. This module
holds the types only; `rollflow.envs.episode` plays episodes.
"""

from __future__ import annotations

import abc
from collections.abc import Awaitable, Callable
from typing import Protocol, runtime_checkable

import msgspec

from rollflow.records import Message, Prompt, Sample, SamplingSpec


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


class Served(abc.ABC):
    """An episode source that holds something for the whole run (a server it started, a
    connection pool): the controller starts it before the run's first episode and closes it at
    the end, however the run ends. A source says so by subclassing this; an episode's own
    environment with `start` and `aclose` methods is not one (its `aclose` ends its episode)."""

    @abc.abstractmethod
    async def start(self) -> None: ...

    @abc.abstractmethod
    async def aclose(self) -> None: ...


GenerateTurn = Callable[[list[int], SamplingSpec, int], Awaitable[Sample]]
"""(token ids so far, sampling with this turn's budget, turn index) -> the turn as a sample."""


class EpisodeLimits(msgspec.Struct, frozen=True, kw_only=True):
    max_turns: int = 4
    max_tokens: int = 256
    """Completion tokens of the whole episode, the model's and the environment's."""
    max_model_len: int = 1024
    """Prompt + completion tokens the engine accepts."""
    max_model_tokens: int = 0
    """The model's tokens of the whole episode, every sequence of it (0: no budget of its own)."""
    time_budget_s: float = 0.0
    """Wall time from the episode's start after which no turn begins (0: no budget)."""
    step_timeout_s: float = 30.0
