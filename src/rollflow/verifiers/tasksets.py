"""verifiers v1 tasksets (the `verifiers.v1` API), trained as they are: `[env] kind = "verifiers"`,
`taskset = "ID"`.

The taskset is loaded with verifiers' own loader (`ID` names the installed module that exports
its `Taskset` subclass in `__all__`; `taskset_args` are fields of its `TasksetConfig`), and its
tasks are the run's prompts: each task's system prompt and prompt, under the id
`ID-<the task's key>` (verifiers' stable task identity), in the run's seeded resumable order.
rollflow plays each task as verifiers' null harness does (the model, and the task's tools if it
has any, with no program in between), generating every turn itself like any sample (streamed,
per-token versions). A task without tools is one reply. A task with tool servers (`toolsets`, the
taskset's and the task's own) is a tool loop: the tools are served in-process
(`rollflow.verifiers.toolsets`; one at a URL is called there) and shown to the chat template; each
turn's Hermes `<tool_call>`s are run and their results come back as tool messages (in the
sequence, out of the loss), until a turn calls no tool, `env.max_turns` turns or the episode's
tokens run out. Then rollflow builds the episode's `vf.Trace` (every turn, its tool calls and
results, as its message graph) and scores it in-process with the task's own `@vf.reward`s,
`@vf.metric`s and judges (`Task.score`): the weighted sum of the rewards is the episode's reward,
reported under the taskset's id, and each reward's score and each metric go to
`Sample.env_metrics` (metrics.jsonl `env_metrics`). A signal that needs a runtime (a sandbox) is
skipped by verifiers; when no reward is left, or a reward raises, returns something that is not a
finite number or runs past `env.step_timeout_s`, the episode is unscorable with the reason.

Supported from verifiers `taskset_loader.SUPPORTED` (tested with 0.3.1 and 0.4.0); what cannot be
trained is refused at start, naming it (`rollflow.verifiers.loader`).
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import msgspec

from rollflow import guest
from rollflow.config import VerifiersEnvConfig
from rollflow.data_files import Row
from rollflow.envs.episode import run_episode
from rollflow.envs.protocol import EnvStep, Turn
from rollflow.envs.tools import split_calls
from rollflow.episodes import EpisodeContext, EpisodeSource, GenerateTurn, failed_episode
from rollflow.errors import ConfigError
from rollflow.records import Message, Prompt, Sample, SamplingSpec
from rollflow.values import finite, shown
from rollflow.verifiers.loader import KEY, Taskset, load_taskset, task_rows
from rollflow.verifiers.toolsets import EpisodeState, ToolServers


class Unscorable(Exception):
    """The task could not score its episode; the message says why."""


class TaskEpisode:
    """One episode of one task, as a rollflow `Environment`: the prompt, the model's turns and
    (with `tools`) their tool calls' results, then the task's score."""

    def __init__(self, task: Any, model: str, tools: ToolServers | None = None, tool_timeout_s: float = 30.0) -> None:
        self.task = task
        self.model = model
        self.tools = tools
        self.tool_timeout_s = tool_timeout_s
        self.history: list[Any] = []
        """The conversation as verifiers messages."""
        self.replies: list[tuple[int, Any, str]] = []
        """Each model turn: (how many messages of `history` came before it, its message, its finish reason)."""
        self.metrics: dict[str, float] = {}
        self.scored = False
        from verifiers.v1.session import hook_boundary
        from verifiers.v1.state import state_cls

        self.state = EpisodeState(state_cls(type(task))())
        """The episode's state (the trace's), which stateful toolsets share."""
        if tools is not None:
            tools.state = self.state

        self.stops = [(hook_boundary(fn, allow_trace=True), fn) for fn in task.hooks("stop")]
        """The task's `@vf.stop`s (a Response's, after each turn; a Trace's, before each later turn)."""

    async def reset(self, prompt: Prompt) -> list[Message]:
        import verifiers.v1 as vf

        kinds = {"system": vf.SystemMessage, "user": vf.UserMessage, "assistant": vf.AssistantMessage}
        self.history = [kinds[m.role](content=m.content) for m in prompt.messages]
        return list(prompt.messages)

    async def step(self, turn: Turn) -> EnvStep:
        import verifiers.v1 as vf

        content, calls = split_calls(turn.text) if self.tools is not None else (turn.text, [])
        tool_calls = [
            vf.ToolCall(id=f"call_{turn.index}_{i}", name=c.name, arguments=json.dumps(c.arguments))
            for i, c in enumerate(calls)
        ]
        reply = vf.AssistantMessage(content=content, tool_calls=tool_calls or None)
        self.replies.append((len(self.history), reply, turn.finish_reason))
        self.history.append(reply)
        stopped = await self._stopped(vf.Response, self._response(len(self.replies) - 1))
        if stopped or not calls or turn.finish_reason == "length" or self.tools is None:
            ended = stopped or ("length" if turn.finish_reason == "length" else "completed")
            return EnvStep(reward=await self.score(ended), done=True)
        results = [await self.tools.call(c, self.tool_timeout_s) for c in calls]
        self.history += [vf.ToolMessage(tool_call_id=t.id, content=r) for t, r in zip(tool_calls, results, strict=True)]
        stopped = await self._stopped(vf.Trace, self.trace(None)) if self.stops else None
        if stopped:  # before the next turn, as verifiers checks them before serving a model call
            return EnvStep(reward=await self.score(stopped), done=True)
        return EnvStep(messages=[Message(role="tool", content=r) for r in results])

    async def _stopped(self, boundary: type, value: Any) -> str | None:
        """The name of the first of the task's stops at `boundary` that fires on `value`."""
        from verifiers.v1.session import call_hook

        for kind, stop in self.stops:
            if kind is boundary:
                fired = await call_hook(stop, {boundary: value})
                if not isinstance(fired, bool):
                    raise TypeError(f"@vf.stop {stop.__name__} returned {shown(fired)}, expected a bool")
                if fired:
                    return stop.__name__
        return None

    async def score(self, stop: str) -> float:
        """The task's score of the episode so far, which ended with `stop` (verifiers' stop condition)."""
        trace = self.trace(stop)
        await self.task.score(trace)
        self.scored = True
        return self.reward(trace)

    def trace(self, stop: str | None) -> Any:
        """The episode as verifiers records it: the task, its state, and every turn in its message
        graph; ended with `stop` when given."""
        import verifiers.v1 as vf
        from verifiers.v1.graph import prepare_turn

        task = self.task
        trace = vf.Trace(
            task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
            agent=vf.AgentInfo(config=vf.AgentConfig(), name="policy"),
            state=self.state.value,
        )
        for i, (before, _, _) in enumerate(self.replies):
            prepare_turn(trace, self.history[:before]).commit(self._response(i))
        if stop is not None:
            trace.stop(stop)
        return trace

    def _response(self, i: int) -> Any:
        """Turn `i` as verifiers records a model response."""
        import verifiers.v1 as vf

        _, message, finish = self.replies[i]
        return vf.Response(
            id=f"turn-{i}", created=int(time.time()), model=self.model, message=message,
            finish_reason="tool_calls" if message.tool_calls and finish != "length" else finish,
        )  # fmt: skip

    def reward(self, trace: Any) -> float:
        return trace_reward(trace, type(self.task).__name__, self.metrics)


def trace_reward(trace: Any, name: str, metrics: dict[str, float]) -> float:
    """The weighted sum of a scored `vf.Trace`'s rewards (of task `name`), after checking each; each
    reward's score and each metric put in `metrics`. Unscorable when it has none, or one is not a
    finite number."""
    scored = {key: r for key, r in trace.rewards.items() if r is not None}
    if not scored:
        raise Unscorable(
            f"task {name} has no reward that runs without a runtime (verifiers skips those that need "
            "a sandbox; rollflow scores in-process)"
        )
    for key, r in scored.items():
        if finite(r.score) is None or finite(r.weight) is None:
            raise Unscorable(f"task {name}'s reward {key} gave {shown(r.score)}, expected a finite number")
        metrics[key] = r.score
    for key, value in trace.metrics.items():
        if value is not None and finite(value) is not None:
            metrics[key] = float(value)
    return float(sum(r.score * r.weight for r in scored.values()))


class TasksetEpisodes(EpisodeSource):
    """A verifiers v1 taskset as a source of episodes: its tasks as the run's prompts, each
    played by `run_episode` (one model turn, or a tool loop for a task with tools) and scored by
    its task. The taskset's own toolsets are set up when the source starts."""

    settings: VerifiersEnvConfig

    def __init__(self, settings: VerifiersEnvConfig, model: str, loaded: Taskset | None = None) -> None:
        self.settings = settings
        self.model = model
        self.name = settings.taskset
        loaded = loaded or load_taskset(settings.taskset, settings.taskset_args, settings.max_tasks)
        if loaded.env is not None:
            raise ConfigError(f"env.taskset: {self.name!r} runs its own environment (taskset_episodes plays it)")
        self.shared = ToolServers(loaded.toolsets)
        self._rows, self.tasks = task_rows(self.name, loaded.tasks)

    async def start(self) -> None:
        try:
            await self.shared.start()
        except ConfigError:
            raise
        except Exception as err:
            why = f"{type(err).__name__}: {err}"
            raise ConfigError(f"env.taskset: setting up {self.name!r}'s toolsets raised {why}") from err

    async def aclose(self) -> None:
        await self.shared.aclose()

    def rows(self) -> list[Row]:
        return self._rows

    async def play(
        self, prompt: Prompt, *, group_id: str, index: int, generate: GenerateTurn, context: EpisodeContext
    ) -> Sample:
        task = self.tasks[prompt.metadata[KEY]]
        own = ToolServers(type(task).toolsets(task.config))
        try:
            return await self._play(task, own, prompt, group_id=group_id, index=index, generate=generate,
                                    context=context)  # fmt: skip
        finally:  # what the task's toolsets hold is the episode's: released with it
            await own.aclose()

    async def _play(
        self, task: Any, own: ToolServers, prompt: Prompt, *, group_id: str, index: int, generate: GenerateTurn,
        context: EpisodeContext,
    ) -> Sample:  # fmt: skip
        limits = context.limits(self.settings)
        tools, failure = await self._tools_for(task, own)
        if failure is not None:
            return failed_episode(prompt, context.sampling, group_id=group_id, index=index, reason=failure,
                                  reward_name=self.name)  # fmt: skip
        if tools is None:
            limits = msgspec.structs.replace(limits, max_turns=1)
        episode = TaskEpisode(task, self.model, tools, self.settings.step_timeout_s)
        sample = await run_episode(
            episode, prompt, context.sampling, generate, context.chat, group_id=group_id, index=index,
            limits=limits, tools=tools.schemas if tools is not None else None, reward_name=self.name,
        )  # fmt: skip
        if not episode.scored and sample.unscorable is None and episode.replies:
            sample = await self._score_cut(episode, sample, limits)
        return msgspec.structs.replace(sample, env_metrics=episode.metrics) if episode.metrics else sample

    async def _tools_for(self, task: Any, own: ToolServers) -> tuple[ToolServers | None, str | None]:
        """The episode's tools (the taskset's and the task's own, `own` set up for it), or None when
        it has none; or why they could not be set up."""
        timeout_s = self.settings.step_timeout_s
        try:
            await asyncio.wait_for(guest.contained(own.start(task)), timeout_s)
        except TimeoutError:
            return None, f"environment: setting up the task's toolsets timed out after {timeout_s:g} s"
        except Exception as err:  # the toolset's bug ends its episode, not the run
            return None, f"environment: setting up the task's toolsets raised {type(err).__name__}: {err}"
        if not own.tools and not self.shared.tools:
            return None, None
        own.schemas = self.shared.schemas + own.schemas
        own.tools = {**self.shared.tools, **own.tools}
        return own, None

    async def _score_cut(self, episode: TaskEpisode, sample: Sample, limits: Any) -> Sample:
        """A tool loop the episode's limits ended (turns, tokens) before the model stopped calling
        tools: the task scores it as it stands, truncated, as verifiers does."""
        stop = "max_turns" if sample.turns >= limits.max_turns else "max_total_tokens"
        try:
            reward = await asyncio.wait_for(guest.contained(episode.score(stop)), self.settings.step_timeout_s)
        except TimeoutError:
            why = f"environment: scoring timed out after {self.settings.step_timeout_s:g} s"
            return msgspec.structs.replace(sample, unscorable=why)
        except Exception as err:
            why = f"environment: scoring raised {type(err).__name__}: {err}"
            return msgspec.structs.replace(sample, unscorable=why)
        return msgspec.structs.replace(sample, process_rewards=[(sample.num_tokens - 1, reward)])


def taskset_episodes(settings: VerifiersEnvConfig, model: str, sampling: SamplingSpec) -> EpisodeSource:
    """`kind = "verifiers"` with `taskset`: the taskset loaded now (what cannot be trained is
    refused at start), played here, or by its own `Env` (`rollflow.verifiers.taskset_envs`)."""
    loaded = load_taskset(settings.taskset, settings.taskset_args, settings.max_tasks, settings.env_id)
    if loaded.env is None:
        _refuse_env_bounds(settings)
        return TasksetEpisodes(settings, model, loaded)
    from rollflow.verifiers.taskset_envs import EnvEpisodes

    return EnvEpisodes(settings, model, sampling, loaded)


ENV_BOUNDS = ("episode_timeout_s", "max_model_tokens", "time_budget_s")
"""Settings that bound the episodes an `Env` plays through the endpoint; rollflow plays a taskset
without one turn by turn, each call bounded by `env.step_timeout_s`."""


def _refuse_env_bounds(settings: VerifiersEnvConfig) -> None:
    """ConfigError naming the `ENV_BOUNDS` given for a taskset that has no `Env` (they would be ignored)."""
    defaults = {f.name: f.default for f in msgspec.structs.fields(settings)}
    given = [f"env.{name}" for name in ENV_BOUNDS if getattr(settings, name) != defaults[name]]
    if given:
        raise ConfigError(
            f"{', '.join(given)}: {settings.taskset!r} has no Env of its own, so nothing would apply "
            "them (its episodes are played turn by turn, each call within env.step_timeout_s); "
            "remove them, or give env.env_id"
        )
