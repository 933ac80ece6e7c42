"""The one seam every source of episodes enters through.

An `EpisodeSource` plays one sample's episode (`play`): the producer gives it the prompt, where
the sample sits in its group, a `generate` that runs one model turn like any sample (streamed,
with per-token versions, surviving weight updates and engine restarts) and the `EpisodeContext`
(the chat template, the run's sampling, the context length). The controller starts it before
the first episode and closes it at the end (it is `Served`), takes the prompts it brings
(`rows`), and never asks what kind it is. `episode_source(config)` picks the adapter `[env]`'s
`kind` names (`SOURCES`), or wraps what was passed in Python (`env=`, `agent=`).

The adapters, each in one module beside the seam it feeds: `rollflow.envs.EnvironmentEpisodes`
(step-wise environments: `tool` and `openenv`), `rollflow.envs.factory.FactoryEpisodes` (TRL's
environment classes), `rollflow.verifiers.tasksets.TasksetEpisodes` (verifiers v1 tasksets: `verifiers`
with `taskset`) and `rollflow.agent.AgentEpisodes` (programs that drive the model through the run's
endpoint: `agent`, and `verifiers` with `environment`). A new source of episodes is
one module with a function `episodes(settings, config) -> EpisodeSource` plus one tagged struct in
`rollflow.config` and one line in `SOURCES`. This module plays no episode itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rollflow.config import AgentEnvConfig, Config, EpisodeConfig, FactoryEnvConfig, ToolEnvConfig
from rollflow.envs.protocol import EpisodeLimits, Served
from rollflow.errors import ConfigError
from rollflow.imports import load_function

if TYPE_CHECKING:
    from rollflow.data_files import Row
    from rollflow.envs.protocol import GenerateTurn
    from rollflow.episodes.chat import ChatFormat
    from rollflow.records import Prompt, Sample, SamplingSpec

SOURCES: dict[str, str] = {
    "tool": "rollflow.envs:tool_episodes",
    "factory": "rollflow.envs.factory:episodes",
    "openenv": "rollflow.envs.openenv:episodes",
    "agent": "rollflow.agent:agent_episodes",
    "verifiers": "rollflow.verifiers.environments:episodes",
}
"""`[env].kind` -> the function (`module:function`, imported when used) that makes its source
from its settings and the run's config."""


@dataclass(frozen=True)
class EpisodeContext:
    """What every episode of a run is played with (known once the model is loaded)."""

    chat: ChatFormat
    """Renders conversations with the model's chat template."""
    sampling: SamplingSpec
    """The run's sampling (each turn's budget is cut from it)."""
    max_model_len: int
    """Prompt + completion tokens the engine accepts."""

    def limits(self, settings: EpisodeConfig) -> EpisodeLimits:
        """An episode's bounds under `settings` (`[env]`'s) in this run."""
        return EpisodeLimits(
            max_turns=settings.max_turns,
            max_tokens=settings.max_tokens,
            max_model_len=self.max_model_len,
            step_timeout_s=settings.step_timeout_s,
        )


class EpisodeSource(Served):
    """Plays one sample's episode; holds what its episodes share for the run (a server, a
    session pool, a loaded environment). `settings` are its `[env]` settings."""

    settings: EpisodeConfig

    replay_on_resume: bool = False
    """Its groups are scored with each episode's live state (TRL's `environments=`), which a
    checkpoint cannot hold: an episode that finished before the checkpoint a run resumes from is
    played again, not taken from the checkpoint."""

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


def episode_source(config: Config, *, env: Any = None, agent: Any = None) -> EpisodeSource | None:
    """What the producer runs for each sample's episode: the source `[env].kind` names, or the
    environment factory (`env`) or agent (`agent`) passed in Python with `[env]`'s settings
    (their defaults without one); None for single-turn samples."""
    settings = config.env
    if env is None and agent is None:
        return None if settings is None else _maker(settings.__struct_config__.tag)(settings, config)
    from rollflow.envs.factory import EnvironmentFactory

    if isinstance(env, EnvironmentFactory):  # TRL's classes (`environment_factory=`)
        from rollflow.envs.factory import episodes

        if settings is not None and not isinstance(settings, FactoryEnvConfig):
            raise ConfigError(
                f"env.kind: {settings.__struct_config__.tag!r} names another source of episodes than the "
                'environment_factory= passed in Python; leave [env] out, or give kind = "factory" with its settings'
            )
        return episodes(settings if isinstance(settings, FactoryEnvConfig) else FactoryEnvConfig(), config, env.factory)
    if env is not None and agent is not None:
        raise ConfigError("give one source of episodes: env= or agent=, not both")
    wanted = ToolEnvConfig if env is not None else AgentEnvConfig
    if settings is not None and not isinstance(settings, wanted):
        raise ConfigError(
            f"env.kind: {settings.__struct_config__.tag!r} names another source of episodes than the "
            f"{'env' if env is not None else 'agent'}= passed in Python; leave [env] out, or give "
            f"kind = {wanted.__struct_config__.tag!r} with its settings"
        )
    if env is not None:
        from rollflow.envs.episode import EnvironmentEpisodes

        return EnvironmentEpisodes(env, settings if isinstance(settings, ToolEnvConfig) else ToolEnvConfig())
    make_agents: Callable[..., EpisodeSource] = _maker("agent")  # the endpoint sits above this seam
    return make_agents(settings if isinstance(settings, AgentEnvConfig) else AgentEnvConfig(), config, agent)


def _maker(kind: Any) -> Callable[[Any, Config], EpisodeSource]:
    return load_function(SOURCES[kind], "env.kind")
