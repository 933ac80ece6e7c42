"""TRL's environment classes, trained unchanged: `[env] kind = "factory"`.

A class written for `GRPOTrainer(environment_factory=...)` has a `reset(**row)` (sync or
async) that may return text, public methods with docstrings that are its tools, and optionally
a `get_reward()` (sync or async) that scores the episode from its own state. Here each episode
gets one new instance: `reset` receives the prompt's dataset row (its columns besides the prompt:
`answer` and the rest), and text it returns is appended to the last user message, as TRL does;
the tools are described to the chat template from their signatures and docstrings
(`transformers.utils.get_json_schema`), the model's Hermes-style tool calls are parsed and run
(sync ones on a thread, each within `env.tool_timeout_s`), and their results come back as `tool`
messages; a tool that raises or times out returns its error to the model, as TRL does. A turn
without a tool call ends the episode, scored by `get_reward()` under the class's name; reward
functions with TRL's signature also receive the group's instances (`environments=`). With
several classes (`factory = {name = "module:Class", ...}`), each row's `environment` column
chooses one, and only its tools are shown.

Bad input is refused at start naming the class or method (no `reset`, a tool without a docstring
or with arguments the schema cannot describe, an unknown class naming close ones); a `reset` or
`get_reward` that raises, hangs or returns the wrong type makes its episode unscorable with the
reason (`rollflow.envs.episode`). This module is the adapter only: it plays episodes through
`run_episode` like every step-wise environment.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import types
from collections.abc import Callable
from typing import Any

from rollflow import guest
from rollflow.config import Config, FactoryEnvConfig
from rollflow.envs.episode import BuildFailed, construct, run_episode
from rollflow.envs.protocol import EnvStep, Turn
from rollflow.envs.tools import call_tool, parse_tool_calls
from rollflow.episodes import EpisodeContext, EpisodeLimits, EpisodeSource, GenerateTurn, failed_episode
from rollflow.errors import ConfigError
from rollflow.imports import load_function
from rollflow.records import Message, Prompt, Sample
from rollflow.values import finite, shown

RESERVED = ("reset", "get_reward")
"""Methods of an environment class that are not tools."""

SELECTOR = "environment"
"""The row column that chooses the class when there are several."""


class EnvironmentClass:
    """One TRL environment class, checked: its tools' schemas, made once from the class."""

    def __init__(self, cls: Any, field: str) -> None:
        name = getattr(cls, "__name__", repr(cls))
        if not callable(cls):
            raise ConfigError(f"{field}: {cls!r} is not a class")
        if not callable(getattr(cls, "reset", None)):
            raise ConfigError(f"{field}: {name} has no `reset` method (TRL's environments reset each episode)")
        self.cls = cls
        self.name = name
        self.tools = [m for m, _ in inspect.getmembers(cls, callable) if not m.startswith("_") and m not in RESERVED]
        self.schemas = [schema_of(cls, method, f"{field}: {name}.{method}") for method in self.tools]
        reward = getattr(cls, "get_reward", None)
        if reward is not None and not callable(reward):
            raise ConfigError(f"{field}: {name}.get_reward is {type(reward).__name__}, expected a method")
        self.has_reward = reward is not None


def schema_of(cls: Any, method: str, where: str) -> dict[str, Any]:
    """The OpenAI function schema of a tool method, from its signature and docstring (what TRL
    and the chat templates use); ConfigError naming it when it has none to give."""
    from transformers.utils import get_json_schema

    func = getattr(cls, method)
    if not inspect.getdoc(func):
        raise ConfigError(f"{where}: a tool needs a docstring that says what it does (Google style, with Args:)")
    try:
        return get_json_schema(types.MethodType(func, object()))  # bound: `self` is not an argument
    except Exception as err:  # transformers' own explanation of what is missing
        raise ConfigError(f"{where}: cannot describe it as a tool ({type(err).__name__}: {err})") from None


async def call(func: Callable[..., Any], timeout_s: float, name: str, **kwargs: Any) -> Any:
    """A user's method, sync (on a guest thread: it may block; abandoned past `timeout_s`) or
    async (its caller bounds it)."""
    if inspect.iscoroutinefunction(func):
        return await func(**kwargs)
    return await guest.call(functools.partial(func, **kwargs), timeout_s=timeout_s, name=name)


class ClassEpisode:
    """One episode of one instance, as a rollflow `Environment`."""

    def __init__(self, spec: EnvironmentClass, instance: Any, limits: EpisodeLimits, tool_timeout_s: float) -> None:
        self.spec = spec
        self.instance = instance
        self.step_timeout_s = limits.step_timeout_s
        self.tool_timeout_s = tool_timeout_s
        self.tools = {name: getattr(instance, name) for name in spec.tools}

    async def reset(self, prompt: Prompt) -> list[Message]:
        row = {k: v for k, v in prompt.metadata.items() if k != SELECTOR}
        if prompt.answer is not None:
            row["answer"] = prompt.answer
        observation = await call(self.instance.reset, self.step_timeout_s, f"{self.spec.name}.reset", **row)
        if observation is not None and not isinstance(observation, str):
            raise TypeError(f"{self.spec.name}.reset returned {shown(observation)}, expected text or None")
        messages = list(prompt.messages)
        if observation:
            last = max((i for i, m in enumerate(messages) if m.role == "user"), default=None)
            if last is None:
                messages.append(Message(role="user", content=observation))
            else:
                messages[last] = Message(role="user", content=messages[last].content + observation)
        return messages

    async def step(self, turn: Turn) -> EnvStep:
        calls, error = parse_tool_calls(turn.text)
        if turn.finish_reason == "length" or (not calls and error is None):
            return EnvStep(reward=await self._reward(), done=True)
        results = [await call_tool(self.tools, c, self.tool_timeout_s) for c in calls]
        if error is not None:
            results.append(error)
        return EnvStep(messages=[Message(role="tool", content=result) for result in results])

    async def _reward(self) -> float | None:
        if not self.spec.has_reward:
            return None
        value = await call(self.instance.get_reward, self.step_timeout_s, f"{self.spec.name}.get_reward")
        reward = finite(value)
        if reward is None:
            raise TypeError(f"{self.spec.name}.get_reward returned {shown(value)}, expected a finite number")
        return reward


class FactoryEpisodes(EpisodeSource):
    """TRL environment classes as a source of episodes; keeps each group's instances until its
    scoring has passed them to the reward functions (`environments=`)."""

    settings: FactoryEnvConfig
    replay_on_resume = True  # reward functions read the group's instances

    def __init__(self, classes: dict[str | None, EnvironmentClass], settings: FactoryEnvConfig) -> None:
        self.classes = classes
        self.settings = settings
        self._instances: dict[str, dict[int, Any]] = {}
        """group id -> sample index -> the instance its episode ran with."""

    async def start(self) -> None:
        """Build each class once: a class that cannot be built is refused before the run loads
        anything, in one line."""
        for spec in self.classes.values():
            try:
                await construct(spec.cls, f"{spec.name}()", self.settings.step_timeout_s)
            except BuildFailed as err:
                raise ConfigError(f"env.factory: {err}") from None

    def _class_for(self, prompt: Prompt) -> EnvironmentClass:
        if None in self.classes:
            return self.classes[None]
        chosen = prompt.metadata.get(SELECTOR)
        if chosen not in self.classes:
            known = ", ".join(repr(k) for k in self.classes)
            raise ValueError(f"the row's `{SELECTOR}` is {chosen!r}, expected one of {known}")
        return self.classes[chosen]

    async def play(
        self, prompt: Prompt, *, group_id: str, index: int, generate: GenerateTurn, context: EpisodeContext
    ) -> Sample:
        limits = context.limits(self.settings)
        try:
            spec = self._class_for(prompt)
        except ValueError as err:
            reason = f"environment: {err}"
            return failed_episode(prompt, context.sampling, group_id=group_id, index=index, reason=reason)
        try:
            instance = await construct(spec.cls, f"{spec.name}()", limits.step_timeout_s)
        except BuildFailed as err:  # the class's failure is its episode's
            reason = f"environment: {err}"
            return failed_episode(prompt, context.sampling, group_id=group_id, index=index, reason=reason)
        episode = ClassEpisode(spec, instance, limits, self.settings.tool_timeout_s)
        self._instances.setdefault(group_id, {})[index] = episode.instance
        return await run_episode(
            episode, prompt, context.sampling, generate, context.chat, group_id=group_id, index=index,
            limits=limits, tools=spec.schemas or None, reward_name=spec.name,
        )  # fmt: skip

    def columns(self, samples: list[Sample]) -> dict[str, list[Any]]:
        kept = self._instances.get(samples[0].group_id, {}) if samples else {}
        return {"environments": [kept.get(s.index) for s in samples]}

    def done(self, group_id: str) -> None:
        self._instances.pop(group_id, None)


def load_classes(given: Any, field: str) -> dict[str | None, EnvironmentClass]:
    """`given` (a class, `"module:Class"`, or a dict of them by name) checked: the classes a
    `FactoryEpisodes` plays."""
    if isinstance(given, dict):
        if not given:
            raise ConfigError(f"{field}: no environment classes")
        return {str(k): _one(v, f"{field}.{k}") for k, v in given.items()}
    return {None: _one(given, field)}


def _one(given: Any, field: str) -> EnvironmentClass:
    if isinstance(given, str):
        module, _, name = given.partition(":")
        try:
            return EnvironmentClass(load_function(given, field), field)
        except ConfigError as err:
            if "has no function" not in str(err):
                raise
            found = vars(__import__(module, fromlist=["_"]))
            close = difflib.get_close_matches(name, [k for k, v in found.items() if isinstance(v, type)], n=3)
            hint = f"; did you mean {', '.join(repr(f'{module}:{c}') for c in close)}?" if close else ""
            raise ConfigError(f"{field}: {module!r} has no class {name!r}{hint}") from None
    return EnvironmentClass(given, field)


def episodes(settings: FactoryEnvConfig, config: Config, given: Any = None) -> FactoryEpisodes:
    """`kind = "factory"`: the class(es) `settings.factory` names, or `given` (passed in Python)."""
    if given is None:
        if not settings.factory:
            raise ConfigError('env.factory: kind = "factory" needs the class, "module:Class" (or classes by name)')
        given = settings.factory
    return FactoryEpisodes(load_classes(given, "env.factory"), settings)


class EnvironmentFactory:
    """`environment_factory=` passed in Python (`rollflow.train`): TRL's environment class, or
    classes by name, to play every episode with (`kind = "factory"`)."""

    def __init__(self, factory: Any) -> None:
        self.factory = factory
