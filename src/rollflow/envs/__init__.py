"""Multi-turn episodes: the model takes a turn, an environment answers, until it says done.

The environment's types are in `rollflow.envs.protocol` (`Environment`, `Turn`, `EnvStep`),
playing an episode in `rollflow.envs.episode`; the seam every source of episodes enters through
(this one, an agent's, an OpenEnv or verifiers environment's) is `rollflow.episodes`, whose
`ChatFormat`, `EpisodeLimits`, `GenerateTurn` and `Served` are re-exported here. Built-in
environments: `calculator` (tool calls, `rollflow.envs.calculator`) and `retry`
(`rollflow.envs.retry`); OpenEnv environments come through `rollflow.envs.openenv`.
"""

from rollflow.envs.episode import (
    EnvironmentEpisodes,
    episode_score,
    load_environment,
    open_environment,
    run_episode,
    tool_episodes,
)
from rollflow.envs.protocol import EnvFactory, Environment, EnvStep, Turn
from rollflow.episodes import EpisodeLimits, GenerateTurn, Served
from rollflow.episodes.chat import ChatFormat
from rollflow.records import Message

__all__ = [
    "ChatFormat",
    "EnvFactory",
    "EnvStep",
    "Environment",
    "EnvironmentEpisodes",
    "EpisodeLimits",
    "GenerateTurn",
    "Message",
    "Served",
    "Turn",
    "episode_score",
    "load_environment",
    "open_environment",
    "run_episode",
    "tool_episodes",
]
