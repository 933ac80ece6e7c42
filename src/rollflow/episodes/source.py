"""The one seam every source of episodes enters through.

An `EpisodeSource` plays one sample's episode (`play`): the producer gives it the prompt, where
the sample sits in its group, a `generate` that runs one model turn like any sample (streamed,
with per-token versions, surviving weight updates and engine restarts) and the `EpisodeContext`
(the chat template, the run's sampling, the context length, the policy version the engine
generates under now). The controller starts it before the first episode and closes it at the
end (it is `Served`), takes the prompts it brings (`rows`), checks the model has a chat template
when it says it renders conversations (`renders_chat`), and never asks what kind it is.

This module holds the seam's types only and imports no adapter: the adapters (step-wise
environments in `rollflow.envs`, agents in `rollflow.agent`, verifiers in `rollflow.verifiers`)
import it, and `rollflow.sources` picks the one `[env].kind` names.
"""

from __future__ import annotations

import abc
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from rollflow.records import Prompt, Sample, SamplingSpec

if TYPE_CHECKING:
    from rollflow.config import EpisodeConfig
    from rollflow.data_files import Row
    from rollflow.episodes.chat import ChatFormat


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


def _first_version() -> int:
    return 0


@dataclass(frozen=True)
class EpisodeContext:
    """What every episode of a run is played with (known once the model is loaded)."""

    chat: ChatFormat
    """Renders conversations with the model's chat template."""
    sampling: SamplingSpec
    """The run's sampling (each turn's budget is cut from it)."""
    max_model_len: int
    """Prompt + completion tokens the engine accepts."""
    version: Callable[[], int] = _first_version
    """The policy version the engine generates under now (a turn started now is stamped with it,
    or a later one)."""

    def limits(self, settings: EpisodeConfig) -> EpisodeLimits:
        """An episode's bounds under `settings` (`[env]`'s) in this run."""
        return EpisodeLimits(
            max_turns=settings.max_turns,
            max_tokens=settings.max_tokens,
            max_model_len=self.max_model_len,
            step_timeout_s=settings.step_timeout_s,
        )

    def adopted(self, sample: Sample, policy: str) -> Sample:
        """`sample`, whose tokens another policy made (a recorded episode played back, a
        teacher's), trained as if generated now: every token stamped with the current version,
        so staleness (`run.max_lag`) never drops it, while its log-probs stay the policy's that
        made it, so the loss's importance ratio weighs the difference. `policy` names that policy
        (`Sample.made_by`; counted per step in `off_policy_samples`)."""
        version = self.version()
        versions = [version] * len(sample.completion_token_ids)
        segments = [
            msgspec.structs.replace(s, versions=[version] * len(s.completion_token_ids)) for s in sample.segments
        ]
        return msgspec.structs.replace(sample, versions=versions, segments=segments, made_by=policy)


class EpisodeSource(Served):
    """Plays one sample's episode; holds what its episodes share for the run (a server, a
    session pool, a loaded environment). `settings` are its `[env]` settings."""

    settings: EpisodeConfig

    replay_on_resume: bool = False
    """Its groups are scored with each episode's live state (TRL's `environments=`), which a
    checkpoint cannot hold: an episode that finished before the checkpoint a run resumes from is
    played again, not taken from the checkpoint."""

    renders_chat: bool = True
    """Its episodes render conversations with the model's chat template (`EpisodeContext.chat`):
    a model without one is refused before anything heavy loads. A source that plays back
    recorded token ids says False."""

    async def start(self) -> None:
        """Start what the run's episodes need (before anything heavy loads, so a bad address
        fails in seconds)."""

    async def aclose(self) -> None:
        """Release it, however the run ends."""

    def rows(self) -> list[Row] | None:
        """The prompts the source brings (a verifiers environment's dataset), or None: the
        run's `[data]` gives them."""
        return None

    async def play(
        self, prompt: Prompt, *, group_id: str, index: int, generate: GenerateTurn, context: EpisodeContext
    ) -> Sample:
        """Sample `index` of group `group_id`: the episode, recorded token by token; an episode
        that fails is an unscorable sample with the reason, never an exception (cancellation
        aside)."""
        raise NotImplementedError

    def columns(self, samples: list[Sample]) -> dict[str, list[Any]]:
        """Columns the source adds to its group's reward-function calls, one value per sample
        (TRL's `environments`); none by default."""
        return {}

    def done(self, group_id: str) -> None:
        """The group's episodes are over (scored or dropped): release what the source kept of them."""
