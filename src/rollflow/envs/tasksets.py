"""verifiers v1 tasksets (the `verifiers.v1` API), trained as they are: `[env] kind = "verifiers"`,
`taskset = "ID"`.

The taskset is loaded with verifiers' own loader (`ID` names the installed module that exports
its `Taskset` subclass in `__all__`; `taskset_args` are fields of its `TasksetConfig`), and its
tasks are the run's prompts: each task's system prompt and prompt, under the id
`ID-<the task's key>` (verifiers' stable task identity), in the run's seeded resumable order.
rollflow generates each reply itself, like any sample (streamed, per-token versions), then builds
the episode's `vf.Trace` (the prompt and the reply as its message graph) and scores it in-process
with the task's own `@vf.reward`s, `@vf.metric`s and judges (`Task.score`): the weighted sum of
the rewards is the episode's reward, reported under the taskset's id, and each reward's score and
each metric go to `Sample.env_metrics` (metrics.jsonl `env_metrics`). A signal that needs a
runtime (a sandbox) is skipped by verifiers; when no reward is left, or a reward raises, returns
something that is not a finite number or runs past `env.step_timeout_s`, the episode is
unscorable with the reason.

Supported: single-turn tasks without tools, from verifiers `SUPPORTED` (tested with 0.3.1 and 0.4.0).
Refused at start, naming what: a taskset whose package runs its own `Env` (multi-turn programs),
tasks with tool servers (`toolsets`) or that need a container, an infinite taskset without
`max_tasks`. The library is imported lazily; without it, one error names the extra.
"""

from __future__ import annotations

import importlib.util
import itertools
import time
from typing import Any

import msgspec

from rollflow.config import VerifiersEnvConfig
from rollflow.data_files import Row
from rollflow.envs.episode import run_episode
from rollflow.envs.protocol import EnvStep, GenerateTurn, Turn
from rollflow.envs.source import EpisodeContext, EpisodeSource
from rollflow.errors import ConfigError, DataError
from rollflow.records import Message, Prompt, Sample
from rollflow.scoring import finite, shown

SUPPORTED = (0, 3, 1), (0, 5, 0)
"""verifiers versions whose v1 tasksets this adapter runs: at least the first, below the second."""

ROLES = {"system", "user", "assistant"}
"""Roles a task's prompt may hold (text only)."""


KEY = "verifiers_task"
"""The row metadata holding its task's key (prompt ids of later epochs carry a suffix)."""


class Unscorable(Exception):
    """The task could not score its episode; the message says why."""


def _v1() -> Any:
    """`verifiers.v1`, or ConfigError saying what to install."""
    from rollflow.agent.verifiers import check_version

    check_version("env.taskset", SUPPORTED, "v1 tasksets", "a newer verifiers is not tested with rollflow yet")
    import verifiers.v1 as vf

    return vf


def load_taskset(taskset_id: str, args: dict[str, Any], max_tasks: int) -> list[Any]:
    """The taskset's tasks (its first `max_tasks`, 0: all), checked: ConfigError naming what cannot
    be trained here."""
    vf = _v1()
    from pydantic import ValidationError
    from verifiers.v1.utils import loaders

    from rollflow.agent.verifiers import _close_modules

    module = taskset_id.rsplit("/", 1)[-1].split("@", 1)[0].replace("-", "_").lower()
    builtin = f"verifiers.v1.tasksets.{module}"
    if not module.isidentifier() or (
        importlib.util.find_spec(module) is None and importlib.util.find_spec(builtin) is None
    ):
        close = _close_modules(module)
        hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        raise ConfigError(f"env.taskset: no verifiers taskset {taskset_id!r} is installed (no module {module!r}){hint}")
    try:
        cls = loaders.taskset_class(taskset_id)
        config_type = loaders.taskset_config_type(taskset_id)
        env_cls = loaders.environment_class(taskset_id)
    except SystemExit as err:
        raise ConfigError(f"env.taskset: importing {taskset_id!r} called sys.exit({err.code!r})") from None
    except Exception as err:  # verifiers' own explanation (no __all__, no Taskset subclass, an import error)
        raise ConfigError(f"env.taskset: {taskset_id!r} could not be loaded: {type(err).__name__}: {err}") from None
    try:
        config = config_type.model_validate({**args, "id": taskset_id})
    except ValidationError as err:
        raise ConfigError(f"env.taskset_args: not a valid {config_type.__name__}: {err}") from None
    _check_trainable(vf, taskset_id, cls, config, env_cls, max_tasks)
    try:
        tasks = list(itertools.islice(cls(config), max_tasks or None))
    except SystemExit as err:
        raise ConfigError(f"env.taskset: loading {taskset_id!r} called sys.exit({err.code!r})") from None
    except Exception as err:
        raise ConfigError(f"env.taskset: loading {taskset_id!r}'s tasks raised {type(err).__name__}: {err}") from None
    if not tasks:
        raise DataError(f"env.taskset: {taskset_id!r} has no tasks")
    return tasks


def _check_trainable(vf: Any, taskset_id: str, cls: Any, config: Any, env_cls: Any, max_tasks: int) -> None:
    name = f"env.taskset: {taskset_id!r}"
    if env_cls is not vf.SingleAgentEnv:
        raise ConfigError(
            f"{name} runs its own environment program ({env_cls.__name__}: multi-turn, through a harness); "
            "rollflow trains single-turn v1 tasks"
        )
    task_type = cls.task_type()
    if task_type.NEEDS_CONTAINER:
        raise ConfigError(f"{name}: its tasks ({task_type.__name__}) need a container, which rollflow does not run")
    if cls.toolsets(config) or task_type.toolsets(config.task):
        raise ConfigError(f"{name}: its tasks have tool servers (toolsets); rollflow trains v1 tasks without tools")
    if cls.INFINITE and not max_tasks:
        raise ConfigError(f"{name} is infinite: give env.max_tasks, how many of its tasks to read")


def task_messages(task: Any, where: str) -> list[Message]:
    """A task's opening as rollflow messages: its system prompt, then its prompt (text or text
    messages); DataError naming the task otherwise."""
    from verifiers.v1.types import content_text

    data = task.data
    messages = [Message(role="system", content=data.system_prompt)] if data.system_prompt else []
    prompt = data.prompt
    if isinstance(prompt, str):
        messages.append(Message(role="user", content=prompt))
    else:
        for message in prompt or []:
            content = message.content
            text_only = isinstance(content, str) or all(part.type == "text" for part in content or [])
            if message.role not in ROLES or not text_only:
                raise DataError(f"{where}: only text system/user/assistant messages are supported, got {message!r:.80}")
            messages.append(Message(role=message.role, content=content_text(content)))
    if not any(m.role == "user" for m in messages):
        raise DataError(f"{where}: the task has no user prompt (a task the user opens is not supported)")
    return messages


class TaskEpisode:
    """One episode of one task, as a rollflow `Environment`: the prompt, one reply, the task's score."""

    def __init__(self, task: Any, model: str) -> None:
        self.task = task
        self.model = model
        self.messages: list[Message] = []
        self.metrics: dict[str, float] = {}

    async def reset(self, prompt: Prompt) -> list[Message]:
        self.messages = list(prompt.messages)
        return list(prompt.messages)

    async def step(self, turn: Turn) -> EnvStep:
        trace = self.trace(turn)
        await self.task.score(trace)
        return EnvStep(reward=self.reward(trace), done=True)

    def trace(self, turn: Turn) -> Any:
        """The episode as verifiers records it: the task, and the prompt and reply as its message graph."""
        import verifiers.v1 as vf
        from verifiers.v1.graph import prepare_turn

        kinds = {"system": vf.SystemMessage, "user": vf.UserMessage, "assistant": vf.AssistantMessage}
        task = self.task
        trace = vf.Trace(
            task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
            agent=vf.AgentInfo(config=vf.AgentConfig(), name="policy"),
        )
        opening = [kinds[m.role](content=m.content) for m in self.messages]
        reply = vf.Response(
            id=f"turn-{turn.index}", created=int(time.time()), model=self.model,
            message=vf.AssistantMessage(content=turn.text), finish_reason=turn.finish_reason,
        )  # fmt: skip
        prepare_turn(trace, opening).commit(reply)
        trace.stop("length" if turn.finish_reason == "length" else "completed")
        return trace

    def reward(self, trace: Any) -> float:
        """The weighted sum of the task's rewards, after checking each; its scores and metrics kept."""
        name = type(self.task).__name__
        scored = {key: r for key, r in trace.rewards.items() if r is not None}
        if not scored:
            raise Unscorable(
                f"task {name} has no reward that runs without a runtime (verifiers skips those that need "
                "a sandbox; rollflow scores in-process)"
            )
        for key, r in scored.items():
            if finite(r.score) is None or finite(r.weight) is None:
                raise Unscorable(f"task {name}'s reward {key} gave {shown(r.score)}, expected a finite number")
            self.metrics[key] = r.score
        for key, value in trace.metrics.items():
            if value is not None and finite(value) is not None:
                self.metrics[key] = float(value)
        return float(sum(r.score * r.weight for r in scored.values()))


class TasksetEpisodes(EpisodeSource):
    """A verifiers v1 taskset as a source of episodes: its tasks as the run's prompts, each
    played by `run_episode` (one model turn) and scored by its task."""

    settings: VerifiersEnvConfig

    def __init__(self, settings: VerifiersEnvConfig, model: str) -> None:
        self.settings = settings
        self.model = model
        self.name = settings.taskset
        tasks = load_taskset(settings.taskset, settings.taskset_args, settings.max_tasks)
        self.tasks: dict[str, Any] = {}
        """task key -> task"""
        self._rows: list[Row] = []
        for i, task in enumerate(tasks):
            where = f"{self.name} task {i}"
            row_id = f"{self.name}-{task.key[:16]}"
            if task.key in self.tasks:
                raise DataError(f"{where}: its key {task.key!r} is another task's too; task keys must be unique")
            answer = getattr(task.data, "answer", None)
            self.tasks[task.key] = task
            self._rows.append(
                Row(
                    id=row_id, messages=task_messages(task, where), answer=None if answer is None else str(answer),
                    task=self.name, metadata={KEY: task.key}, source=where,
                )
            )  # fmt: skip

    def rows(self) -> list[Row]:
        return self._rows

    async def play(
        self, prompt: Prompt, *, group_id: str, index: int, generate: GenerateTurn, context: EpisodeContext
    ) -> Sample:
        limits = msgspec.structs.replace(context.limits(self.settings), max_turns=1)
        episode = TaskEpisode(self.tasks[prompt.metadata[KEY]], self.model)
        sample = await run_episode(
            episode, prompt, context.sampling, generate, context.chat, group_id=group_id, index=index,
            limits=limits, reward_name=self.name,
        )  # fmt: skip
        return msgspec.structs.replace(sample, env_metrics=episode.metrics) if episode.metrics else sample
