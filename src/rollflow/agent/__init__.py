"""Agents written against the OpenAI chat API or Anthropic's Messages API, trained as they are.

`[env] kind = "agent"`, `function = "module:function"` names `async def agent(task, base_url)
-> float | None` (a sync function runs in a thread). For each episode the run opens a base URL on its
endpoint (`rollflow.agent.server`) and a key that selects the episode on the run's one URL
(`AgentTask.api_key`, `AgentTask.environ` for a program that reads `OPENAI_BASE_URL` or
`ANTHROPIC_BASE_URL` and a key from its environment), calls the agent with the episode's
`AgentTask` and that URL, and records every completion it serves token-in/token-out (`rollflow.agent.episode`): the
sampled tokens exactly, their behaviour log-probs and per-token versions, the agent's tool results
and messages masked out of the loss.

The agent's return value is the episode's reward (the part `env`); None leaves scoring to
`[[scoring.rewards]]`, which read the episode's last conversation as the completion. An agent that
raises, returns something other than a finite number or None, or runs past `env.episode_timeout_s`
makes its episode unscorable with the reason; the run goes on. `AgentEpisodes` is the source of
such episodes (`rollflow.episodes`); a verifiers environment (`kind = "verifiers"`) is such an
agent too (`rollflow.verifiers.environments`), with its own prompts. This module does not generate (the
producer's `generate` does) or score.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import msgspec

from rollflow import guest
from rollflow.agent.episode import AgentEpisode, BadRequest, Reply
from rollflow.agent.http import http_client
from rollflow.agent.server import AgentServer
from rollflow.config import AgentEnvConfig, Config, EndpointConfig
from rollflow.data_files import Row
from rollflow.episodes import EpisodeContext, EpisodeLimits, EpisodeSource, GenerateTurn, Served
from rollflow.errors import ConfigError, GuestStuckError
from rollflow.guest import name_of, raised
from rollflow.imports import load_function
from rollflow.records import Prompt, Sample, SamplingSpec
from rollflow.scoring import is_async
from rollflow.values import finite, shown

__all__ = [
    "AgentEpisode",
    "AgentEpisodes",
    "AgentServer",
    "AgentTask",
    "BadRequest",
    "Reply",
    "agent_episodes",
    "http_client",
    "load_agent",
    "run_agent",
]

Agent = Callable[..., Any]
"""`agent(task: AgentTask, base_url: str) -> float | None`, sync or async."""


class AgentTask(msgspec.Struct, frozen=True, kw_only=True):
    """What an agent is given for one episode."""

    id: str
    """The prompt's id (the ledger's key)."""
    messages: list[dict[str, str]]
    """The prompt's messages in the OpenAI form (`{"role": ..., "content": ...}`)."""
    model: str
    """The model name to ask the endpoint for."""
    answer: str | None = None
    """The prompt's reference answer, if the dataset has one."""
    task: str = ""
    metadata: dict[str, Any] = {}
    endpoint: str = ""
    """The run's one URL (`http://HOST:PORT`), the same for every episode: with `api_key` it serves
    this episode, for clients that take a base URL and a key from their environment."""
    api_key: str = ""
    """This episode's key (random, dead once the episode ends): a bearer token or `x-api-key`."""

    @property
    def environ(self) -> dict[str, str]:
        """The variables the official clients read (OpenAI's and Anthropic's base URL and key), set to
        this episode: pass them to a program (`subprocess.run(..., env=os.environ | task.environ)`)."""
        return {
            "OPENAI_BASE_URL": f"{self.endpoint}/v1",
            "OPENAI_API_KEY": self.api_key,
            "ANTHROPIC_BASE_URL": self.endpoint,
            "ANTHROPIC_API_KEY": self.api_key,
        }

    @property
    def prompt(self) -> str:
        """The last user message's text."""
        users = [m["content"] for m in self.messages if m["role"] == "user"]
        return users[-1] if users else ""


def task_of(prompt: Prompt, model: str) -> AgentTask:
    return AgentTask(
        id=prompt.id,
        messages=[{"role": m.role, "content": m.content} for m in prompt.messages],
        model=model,
        answer=prompt.answer,
        task=prompt.task,
        metadata=dict(prompt.metadata),
    )


def load_agent(name: str) -> Agent:
    """The function `env.function` names (`module:function`)."""
    return load_function(name, "env.function")


class AgentEpisodes(EpisodeSource):
    """Programs that drive the model themselves, as a source of episodes: each episode runs
    `agent` against its own base URL on the run's endpoint (`AgentServer`, started with the
    source), within `settings`' limits. `rows`: makes the prompts the agent brings (a verifiers
    environment's dataset). An agent that holds something for the run (`Served`) is started and
    closed with the source."""

    settings: EndpointConfig

    def __init__(
        self,
        agent: Agent,
        settings: EndpointConfig,
        *,
        model: str,
        sampling: SamplingSpec,
        rows: Callable[[], list[Row]] | None = None,
    ) -> None:
        self.agent = agent
        self.settings = settings
        self._rows = rows
        self.server = AgentServer(
            model, sampling, host=settings.host, port=settings.port, call_timeout_s=settings.step_timeout_s
        )

    async def start(self) -> None:
        if isinstance(self.agent, Served):
            await self.agent.start()
        await self.server.start()

    async def aclose(self) -> None:
        await self.server.aclose()
        if isinstance(self.agent, Served):
            await self.agent.aclose()

    def rows(self) -> list[Row] | None:
        return self._rows() if self._rows is not None else None

    async def play(
        self, prompt: Prompt, *, group_id: str, index: int, generate: GenerateTurn, context: EpisodeContext
    ) -> Sample:
        episode = AgentEpisode(
            prompt, context.sampling, generate, context.chat, endpoint_limits(context, self.settings)
        )
        return await run_agent(
            self.agent, episode, self.server, group_id=group_id, index=index, timeout_s=self.settings.episode_timeout_s
        )


def endpoint_limits(context: EpisodeContext, settings: EndpointConfig) -> EpisodeLimits:
    """An endpoint episode's bounds: the episode's, with the budgets only the endpoint enforces."""
    budgets = {"max_model_tokens": settings.max_model_tokens, "time_budget_s": settings.time_budget_s}
    return msgspec.structs.replace(context.limits(settings), **budgets)


def agent_episodes(settings: AgentEnvConfig, config: Config, agent: Agent | None = None) -> AgentEpisodes:
    """`kind = "agent"`: the function `settings.function` names, or `agent` (passed in Python)."""
    from rollflow.sampler import sampling_spec

    if agent is None:
        if not settings.function:
            raise ConfigError('env.function: kind = "agent" needs the agent, "module:function"')
        agent = load_agent(settings.function)
    return AgentEpisodes(agent, settings, model=config.model.path, sampling=sampling_spec(config))


async def run_agent(
    agent: Agent,
    episode: AgentEpisode,
    server: AgentServer,
    *,
    group_id: str,
    index: int,
    timeout_s: float,
) -> Sample:
    """Run one episode of `agent` against its own base URL; the recorded sample, unscorable with
    the reason when the agent failed."""
    key, base_url = server.open(episode)
    task = msgspec.structs.replace(
        task_of(episode.prompt, server.model), endpoint=server.url, api_key=server.api_key(key)
    )
    failure: str | None = None
    reward: float | None = None
    try:
        if is_async(agent):
            result = await asyncio.wait_for(guest.contained(agent(task, base_url)), timeout_s)
        else:  # its time counts from when a guest thread starts it
            result = await guest.call(agent, task, base_url, timeout_s=timeout_s, name=f"agent {name_of(agent)}")
        reward, failure = _checked(result)
    except TimeoutError:
        failure = f"agent: timed out after {timeout_s:g} s (env.episode_timeout_s)"
    except GuestStuckError as err:
        failure = str(err)
    except (Exception, SystemExit) as err:  # the agent's bug (or exit) ends its episode, not the run
        failure = f"agent: {raised(err)}"
    finally:
        server.close(key)
    return episode.sample(group_id, index, reward=reward, failure=failure)


def _checked(result: Any) -> tuple[float | None, str | None]:
    """(the reward, None), or (None, why the result is not one)."""
    if result is None:
        return None, None
    reward = finite(result)
    if reward is None:
        return None, f"agent: returned {shown(result)}, expected a finite number or None"
    return reward, None
