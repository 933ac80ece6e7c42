"""The kind table: which source of episodes `[env].kind` names, and the one function that makes it.

`episode_source(config)` makes the source `[env]`'s `kind` names (`SOURCES`), or wraps what was
passed in Python (`env=`, `agent=`). The adapters, each one module beside the seam it feeds
(`rollflow.episodes`): `rollflow.envs.EnvironmentEpisodes` (step-wise environments: `tool` and
`openenv`), `rollflow.envs.factory.FactoryEpisodes` (TRL's environment classes),
`rollflow.verifiers.tasksets.TasksetEpisodes` (verifiers v1 tasksets: `verifiers` with `taskset`)
and `rollflow.agent.AgentEpisodes` (programs that drive the model through the run's endpoint:
`agent`, and `verifiers` with `environment`). A new source of episodes is one module with a
function `episodes(settings, config) -> EpisodeSource` plus one tagged struct in `rollflow.config`
and one line in `SOURCES`. This module sits above every adapter (it imports each only when its
kind is asked for) and plays no episode.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rollflow.config import AgentEnvConfig, Config, FactoryEnvConfig, ToolEnvConfig
from rollflow.episodes import EpisodeSource
from rollflow.errors import ConfigError
from rollflow.imports import load_function

SOURCES: dict[str, str] = {
    "tool": "rollflow.envs:tool_episodes",
    "factory": "rollflow.envs.factory:episodes",
    "openenv": "rollflow.envs.openenv:episodes",
    "agent": "rollflow.agent:agent_episodes",
    "verifiers": "rollflow.verifiers.environments:episodes",
}
"""`[env].kind` -> the function (`module:function`, imported when used) that makes its source
from its settings and the run's config."""


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
    make_agents: Callable[..., EpisodeSource] = _maker("agent")
    return make_agents(settings if isinstance(settings, AgentEnvConfig) else AgentEnvConfig(), config, agent)


def _maker(kind: Any) -> Callable[[Any, Config], EpisodeSource]:
    return load_function(SOURCES[kind], "env.kind")
