"""Scoring: from a group's completions to rewards, or explicit reasons there are none.

A reward is a function with the TRL signature, `(prompts, completions, **kwargs) ->
list[float | None]`, sync or async, called once per group: `prompts` holds the prompt's last
user message once per completion, `completions` the decoded completions, and the keyword
arguments carry the dataset's columns the same way (`answer`, `task`, `metadata`, each metadata
key as its own column) plus `completion_ids` (token ids). Several rewards are summed with their
weights. Sync functions run on a thread pool (never on the event loop); every call has a
timeout. A value that is None, NaN or infinite, not a number, or missing (a list of the wrong
length), and a function that raises or times out, make the sample *unscorable* with a reason
naming the reward: it is left out of its group's baseline and counted, never scored 0.

A process reward (`process = true`) returns, per completion, a list of `[token_index, reward]`
pairs instead of one number: steps of the completion ending at those tokens. Their weighted sum
counts in the total like any reward; the steps are kept on the sample for per-token credit
(`scoring.process_coef`). An environment's per-turn rewards arrive the same way, as the part
`env` (`Scorer.score`'s `prior`).

A function can also give one sample's reason itself: an `Unscorable("why")` in place of its
value makes that sample unscorable with the reason.

Built-in rewards: `verifier` (the prompt's task checker: 1.0 correct, 0.0 wrong; a reasoning-gym
task's is the dataset's `score_answer`), `math_verify` (math-verify's judgement of the final
answer against the row's `answer`, in worker processes: `rollflow.scoring.math_verify`) and
`digits` (the fraction of the completion's characters that are digits — a trivially learnable
signal for smoke tests). Remote reward servers: `rollflow.scoring.remote.RemoteReward`.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import Callable
from typing import Any, Literal

import msgspec

from rollflow import guest
from rollflow.config import RewardConfig, ScoringConfig
from rollflow.errors import ConfigError
from rollflow.imports import load_function
from rollflow.records import Prompt
from rollflow.tasks import Task, parse_task, verify
from rollflow.values import finite, shown

RewardName = Literal["verifier", "digits", "math_verify"]
RewardFunc = Callable[..., Any]
"""`(prompts, completions, **kwargs) -> list[float | None]`, or a coroutine function returning it."""


def digits_reward(text: str) -> float:
    """Fraction of characters that are digits (0.0 for an empty completion)."""
    return sum(c.isdigit() for c in text) / len(text) if text else 0.0


def digits(prompts: list[str], completions: list[str], **kwargs: Any) -> list[float | None]:
    """Built-in `digits` reward."""
    return [digits_reward(text) for text in completions]


def verifier(
    prompts: list[str],
    completions: list[str],
    *,
    answer: list[Any],
    task: list[str],
    metadata: list[dict],
    **kwargs: Any,
) -> list[float | Unscorable]:
    """Built-in `verifier` reward: the task's own checker, one completion at a time (a checker
    that raises on one completion makes that sample unscorable, not its group)."""
    return [_verified(t, c, a, m) for c, a, t, m in zip(completions, answer, task, metadata, strict=True)]


def _verified(task: str, completion: str, answer: Any, metadata: dict) -> float | Unscorable:
    try:
        return float(verify(task, completion, answer, metadata))
    except Exception as err:  # a checker's bug is its sample's reason
        return Unscorable(f"raised {type(err).__name__}: {err}")


BUILTIN: tuple[str, ...] = ("verifier", "digits", "math_verify")
"""The built-in rewards' names."""


class Unscorable(msgspec.Struct, frozen=True):
    """What a reward function returns for a sample it cannot score, with the reason (the sample
    is then unscorable, never scored 0)."""

    reason: str


class Scored(msgspec.Struct, frozen=True):
    """One completion's total reward, or the reason it has none, and each reward's value."""

    reward: float | None
    reason: str | None = None
    parts: dict[str, float] = {}
    steps: list[tuple[int, float]] = []
    """Process rewards: (index of the completion token ending the step, weighted reward)."""


NO_REWARD = "no reward: the environment or agent gave none and no reward function is configured"


class Reward:
    """One reward function with its name, weight and timeout."""

    def __init__(
        self,
        name: str,
        func: RewardFunc,
        *,
        weight: float = 1.0,
        timeout_s: float | None = 30.0,
        inline: bool = False,
        process: bool = False,
    ) -> None:
        self.process = process
        """Returns [token_index, reward] pairs per completion instead of one number."""
        self.name = name
        self.func = func
        self.weight = weight
        self.timeout_s = timeout_s
        """Per call; None for a function that bounds each of its own units of work (`math_verify`)."""
        self.inline = inline
        """Run a sync function on the event loop itself (the built-ins: microseconds of work)."""
        self.is_async = is_async(func)


def is_async(func: Any) -> bool:
    """Whether calling `func` gives a coroutine: a coroutine function, or an object whose
    `__call__` is one."""
    return inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(
        getattr(func, "__call__", None)  # noqa: B004 - an object whose __call__ is async
    )


def builtin_reward(name: str, task: Task | None = None, *, weight: float = 1.0, timeout_s: float = 30.0) -> Reward:
    """The built-in reward `name` for prompts of `task` (`data.task` parsed). The checkers of the
    built-in tasks and `digits` take microseconds and run on the event loop; a slow checker (a
    reasoning-gym dataset's) runs on a thread with `timeout_s`, and `math_verify` in its worker
    processes."""
    if name == "math_verify":
        from rollflow.scoring.math_verify import MathVerify

        # Bounded judgement by judgement; a time limit on a whole group's call would count the
        # wait for workers other groups hold.
        return Reward(name, MathVerify(), weight=weight, timeout_s=None)
    if name == "verifier" and task is not None and task.slow_checker:
        return Reward(name, verifier, weight=weight, timeout_s=timeout_s)
    checkers: dict[str, RewardFunc] = {"verifier": verifier, "digits": digits}
    return Reward(name, checkers[name], weight=weight, inline=True)


def make_reward(
    config: RewardConfig, index: int, given: dict[str, RewardFunc] | None = None, task: Task | None = None
) -> Reward:
    """The reward a `[[scoring.rewards]]` entry describes (`task`: `data.task` parsed, which
    decides where a built-in checker runs)."""
    field = f"scoring.rewards[{index}]"
    sources = [bool(config.function), bool(config.url)]
    if sum(sources) > 1:
        raise ConfigError(f"{field}: give `function` or `url`, not both")
    if config.url:
        from rollflow.scoring.remote import RemoteReward

        func: RewardFunc = RemoteReward(
            config.url,
            timeout_s=config.timeout_s,
            max_retries=config.max_retries,
            backoff_s=config.backoff_s,
            token_env=config.token_env,
            max_connections=config.max_connections,
        )
        # The client times each attempt; the call as a whole may take every retry and backoff.
        total = (config.timeout_s + config.backoff_s * 2**config.max_retries) * (config.max_retries + 1)
        return Reward(config.name, func, weight=config.weight, timeout_s=total, process=config.process)
    if config.function:
        func = load_function(config.function, f"{field}.function")
    elif given and config.name in given:
        func = given[config.name]
    elif config.name in BUILTIN:
        if config.process:
            raise ConfigError(f"{field}: the built-in {config.name!r} is not a process reward")
        return builtin_reward(config.name, task, weight=config.weight, timeout_s=config.timeout_s)
    else:
        raise ConfigError(
            f"{field}: {config.name!r} is not a built-in reward ({', '.join(BUILTIN)}); give `function` or `url`"
        )
    return Reward(config.name, func, weight=config.weight, timeout_s=config.timeout_s, process=config.process)


def make_rewards(
    scoring: ScoringConfig,
    default: str,
    given: dict[str, RewardFunc] | None = None,
    *,
    env: bool = False,
    task: Task | None = None,
) -> list[Reward]:
    """The configured rewards and the functions `given` in Python; without any, `default`
    (run.reward), unless an environment (`env`) gives the rewards. `task`: `data.task` parsed."""
    given = dict(given or {})
    rewards = [make_reward(c, i, given, task) for i, c in enumerate(scoring.rewards)]
    named = {r.name for r in rewards}
    rewards += [Reward(name, func) for name, func in given.items() if name not in named]
    if env:
        return rewards
    return rewards or [builtin_reward(default, task)]


def _prompt_text(prompt: Prompt) -> str:
    users = [m.content for m in prompt.messages if m.role == "user"]
    return users[-1] if users else ""


class Scorer:
    """Scores whole groups with every reward, concurrently with generation."""

    def __init__(self, rewards: list[Reward], *, max_concurrency: int = 16) -> None:
        self.rewards = rewards
        self._slots = asyncio.Semaphore(max_concurrency)

    async def score(
        self,
        prompt: Prompt,
        completions: list[str],
        completion_ids: list[list[int]],
        prior: list[Scored] | None = None,
        extra: dict[str, list[Any]] | None = None,
    ) -> list[Scored]:
        """Every reward of every completion. `prior`: what each sample earned already (an
        environment's rewards as part `env`, or the reason it failed), added to the total.
        `extra`: more columns for the reward functions, one value per completion (TRL's
        `environments`)."""
        n = len(completions)
        columns: dict[str, list[Any]] = {key: [value] * n for key, value in prompt.metadata.items()}
        columns |= {
            "answer": [prompt.answer] * n,
            "task": [prompt.task] * n,
            "metadata": [prompt.metadata] * n,
            "completion_ids": completion_ids,
            **(extra or {}),
        }
        prompts = [_prompt_text(prompt)] * n
        async with self._slots:
            if not self.rewards:
                results = []
            elif len(self.rewards) == 1:  # the common case, without gather's tasks
                results = [await self._call(self.rewards[0], prompts, completions, columns)]
            else:
                results = await asyncio.gather(*(self._call(r, prompts, completions, columns) for r in self.rewards))
        scored = []
        for i in range(n):
            before = prior[i] if prior is not None else Scored(None)
            parts: dict[str, float] = dict(before.parts)
            steps = list(before.steps)
            reason = before.reason
            total = before.reward or 0.0
            for reward, (values, error) in zip(self.rewards, results, strict=True):
                pairs: list[tuple[int, float]] = []
                why: str | None
                value: float | None
                if error:
                    value, why = None, error
                elif reward.process:
                    pairs, why = _check_steps(values[i], len(completion_ids[i]))
                    value = sum(r for _, r in pairs)
                else:
                    value, why = _check(values[i])
                if why is not None:
                    reason = reason or f"reward {reward.name}: {why}"
                    continue
                assert value is not None
                parts[reward.name] = value
                total += reward.weight * value
                steps += [(end, reward.weight * r) for end, r in pairs]
            if reason is None and not parts:
                reason = NO_REWARD
            scored.append(Scored(None, reason, parts) if reason else Scored(total, None, parts, steps))
        return scored

    async def _call(
        self, reward: Reward, prompts: list[str], completions: list[str], columns: dict[str, list[Any]]
    ) -> tuple[list[Any], str | None]:
        """(values, None) or ([], the reason the whole call failed)."""
        try:
            if reward.inline and not reward.is_async:
                values = reward.func(prompts, completions, **columns)
            elif reward.is_async:
                call = guest.contained(reward.func(prompts, completions, **columns))
                values = await asyncio.wait_for(call, reward.timeout_s)
            else:  # a guest thread: one that hangs is abandoned at its timeout, never waited for
                bound = functools.partial(reward.func, prompts, completions, **columns)
                values = await guest.call(bound, timeout_s=reward.timeout_s, name=f"reward {reward.name}")
        except TimeoutError:
            return [], f"timed out after {reward.timeout_s:g} s"
        except (Exception, SystemExit) as err:  # a broken reward makes its samples unscorable, not 0
            return [], guest.raised(err)
        if not isinstance(values, (list, tuple)) or len(values) != len(completions):
            got = f"{len(values)} values" if isinstance(values, (list, tuple)) else type(values).__name__
            return [], f"returned {got} for {len(completions)} completions"
        return list(values), None

    async def aclose(self) -> None:
        for reward in self.rewards:
            close = getattr(reward.func, "aclose", None)
            if close is not None:
                await close()


def _check(value: Any) -> tuple[float | None, str | None]:
    if isinstance(value, Unscorable):
        return None, value.reason
    if value is None:
        return None, "returned None"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None, f"returned {value!r} ({type(value).__name__}), expected a number or None"
    number = finite(value)
    if number is None:
        if isinstance(value, float):
            return None, f"returned {value}"
        return None, f"returned {shown(value)}, expected a finite number (it is too large for a float)"
    return number, None


def _check_steps(value: Any, length: int) -> tuple[list[tuple[int, float]], str | None]:
    """A process reward's value for one completion: [token_index, reward] pairs."""
    if value is None:
        return [], "returned None"
    if not isinstance(value, (list, tuple)):
        return [], f"returned {type(value).__name__}, expected a list of [token_index, reward] pairs"
    pairs = []
    for item in value:
        if not isinstance(item, (list, tuple)) or len(item) != 2:
            return [], f"returned {item!r}, expected a [token_index, reward] pair"
        end, raw = item
        if isinstance(end, bool) or not isinstance(end, int) or not 0 <= end < length:
            return [], f"returned step end {end!r}, expected a token index in [0, {length})"
        reward, why = _check(raw)
        if why is not None:
            return [], f"step at token {end} {why}"
        assert reward is not None
        pairs.append((end, reward))
    return pairs, None


def eval_scorer(config: Any, task: Task | None = None) -> Scorer:
    """The scorer of held-out evaluation: `run.reward` alone, for the prompts of `data.task`
    (`task`: it parsed already)."""
    reward = builtin_reward(config.run.reward, task or parse_task(config.data))
    return Scorer([reward], max_concurrency=config.scoring.max_concurrency)
