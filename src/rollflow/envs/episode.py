"""Playing a step-wise environment's episode, token-in/token-out.

`run_episode` keeps the episode as one token sequence: the model's tokens are appended exactly as
sampled (never re-tokenised), with their behaviour log-probs and per-token versions; what the
environment says is rendered with the chat template and tokenised on its own
(`ChatFormat.extend`), appended with loss mask 0. Each model turn is one generation call (the
caller's `generate`, which streams it like any sample: a weight update during the turn follows the
partial-rollout mode, and a turn starts under whatever weights the engine has by then), so an
episode interrupted by an update resumes at its turn boundary with every earlier turn kept.

Environment failures are the episode's, not the run's: a `reset` or `step` that raises, runs
past `step_timeout_s` or returns the wrong type ends the episode unscorable with the reason.
`EnvironmentEpisodes` is the episode source (`rollflow.episodes`) of step-wise environments:
rollflow's own (`kind = "tool"`: `calculator`, `retry`, or a class of yours) and OpenEnv's
(`rollflow.envs.openenv`). `episode_score` hands an episode's rewards to scoring. This module does
not run reward functions (`rollflow.scoring`) or generate (the caller's `generate` does).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any

import msgspec

from rollflow import guest
from rollflow.config import Config, ToolEnvConfig
from rollflow.envs.protocol import EnvFactory, Environment, EnvStep, Turn
from rollflow.envs.tools import STEP_LIMIT
from rollflow.episodes import (
    EpisodeContext,
    EpisodeLimits,
    EpisodeSource,
    GenerateTurn,
    Recording,
    Sequence,
    Served,
    failed_episode,
    sample_of,
)
from rollflow.episodes.chat import ChatFormat
from rollflow.errors import ConfigError
from rollflow.guest import name_of, raised
from rollflow.imports import load_function
from rollflow.records import Message, Prompt, Sample, SamplingSpec
from rollflow.scoring import Scored, is_async
from rollflow.values import finite, shown

if TYPE_CHECKING:
    from rollflow.config import EpisodeConfig

log = logging.getLogger(__name__)


async def run_episode(
    env: Environment,
    prompt: Prompt,
    sampling: SamplingSpec,
    generate: GenerateTurn,
    chat: ChatFormat,
    *,
    group_id: str,
    index: int,
    limits: EpisodeLimits,
    tools: list[dict[str, Any]] | None = None,
    reward_name: str = "env",
) -> Sample:
    """Play one episode; the result is one sample whose completion is every turn after the opening
    messages, with loss mask 1 on the model's tokens and 0 on the environment's. Environment
    tokens carry log-prob 0 and the version of the model token before them (so they never make
    the sample look staler than its oldest model token). An environment failure makes the sample
    unscorable with the reason.

    A chat template that renders the conversation so far differently from the tokens already in
    the sequence (Qwen3's drops earlier turns' `<think>` blocks) cannot be continued token by
    token: the sequence so far becomes a segment of the sample (`Sample.segments`, trained with
    its reward and advantage) and the next turn starts a new sequence from the template's own
    rendering. `limits.max_tokens` counts the completion tokens of all of them. `tools`: the
    environment's tools as OpenAI function schemas, shown by templates that show them;
    `reward_name`: what its rewards are reported as (`Sample.env_reward`)."""
    play = _Play(env, chat, limits, tools, reward_name)
    try:
        going = await play.open(prompt)
        while going and play.record.turns < limits.max_turns:
            going = await play.turn(sampling, generate)
    finally:
        await _close(env, limits.step_timeout_s)
    return sample_of(prompt, play.recording(), group_id=group_id, index=index, sampling=sampling)


class _Play:
    """One episode's phases: the opening, each model turn and the environment's answer, and what
    the environment said added to the sequence (or a new sequence when the template rewrites
    history). Each phase returns whether the episode goes on; `record` says how it ended."""

    def __init__(
        self,
        env: Environment,
        chat: ChatFormat,
        limits: EpisodeLimits,
        tools: list[dict[str, Any]] | None,
        reward_name: str,
    ) -> None:
        self.env, self.chat, self.limits, self.tools = env, chat, limits, tools
        self.record = Recording(finish_reason="length", turns=0, reward_name=reward_name)
        self.seq = Sequence(opening=[])
        self.messages: list[Message] = []
        self.steps: list[tuple[int, float]] = []
        """The current sequence's turn rewards (at the token that ends each turn)."""
        self.carried = 0.0
        """Rewards of turns in closed sequences (anchored on the last sequence's last token)."""

    async def open(self, prompt: Prompt) -> bool:
        try:
            reset = self.env.reset(prompt)
            self.messages = _opening(await _bounded(reset, self.limits.step_timeout_s, "reset"))
        except _EnvFailed as err:  # no episode: the sample is the prompt alone, unscorable
            self.record.failure, self.record.finish_reason = str(err), "stop"
            self.seq = Sequence(opening=prompt.token_ids)
            return False
        rendered = self.chat.render(self.messages, self.tools)
        self.seq = Sequence(opening=self.chat.tokens(rendered), rendered=rendered)
        return True

    def _spent(self) -> int:
        """Completion tokens of the episode so far, every sequence of it."""
        return sum(len(c.tokens) for c in self.record.closed) + len(self.seq.tokens)

    async def turn(self, sampling: SamplingSpec, generate: GenerateTurn) -> bool:
        """One model turn, within what is left of the episode's tokens, and the environment's answer."""
        seq, limits, record = self.seq, self.limits, self.record
        room = min(limits.max_tokens - self._spent(), limits.max_model_len - len(seq.opening) - len(seq.tokens))
        budget = min(sampling.max_tokens, room)
        if budget <= 0:
            record.finish_reason = "length"
            return False
        spec = msgspec.structs.replace(sampling, max_tokens=budget)
        turn = await generate(seq.opening + seq.tokens, spec, record.turns)
        seq.add(turn.completion_token_ids, turn.logprobs, turn.versions, 1)
        record.interruptions += turn.interruptions
        record.finish_reason = turn.finish_reason
        text = self.chat.tokenizer.decode(turn.completion_token_ids, skip_special_tokens=False)
        seq.rendered += text
        self.messages.append(Message(role="assistant", content=self.chat.assistant_content(text)))
        plain = self.chat.tokenizer.decode(turn.completion_token_ids, skip_special_tokens=True)
        try:
            seen = Turn(text=plain, finish_reason=turn.finish_reason, index=record.turns)
            result = _answer(await _bounded(self.env.step(seen), limits.step_timeout_s, "step"))
        except _EnvFailed as err:
            record.failure = str(err)
            return False
        record.turns += 1
        if result.reward is not None and seq.tokens:
            self.steps.append((len(seq.tokens) - 1, result.reward))
        if result.done or not result.messages:
            record.finish_reason = "stop" if result.done else record.finish_reason
            return False
        self.messages += result.messages
        return self._extend()

    def _extend(self) -> bool:
        """What the environment said, tokenised on its own and appended with loss mask 0; False
        when no room is left for another turn after it."""
        seq, limits = self.seq, self.limits
        spent = self._spent()
        try:
            seq.rendered, added = self.chat.extend(seq.rendered, self.messages, self.tools)
        except ValueError:  # the template rewrites history: the next turn starts a new sequence
            return self._split(spent)
        if spent + len(added) >= limits.max_tokens or (
            len(seq.opening) + len(seq.tokens) + len(added) >= limits.max_model_len
        ):
            self.record.finish_reason = "length"
            return False
        last_version = seq.versions[-1] if seq.versions else 0
        seq.add(added, [0.0] * len(added), [last_version] * len(added), 0)
        return True

    def _split(self, spent: int) -> bool:
        """Close the sequence and start the next from the template's own rendering, if a turn fits."""
        limits = self.limits
        rendered = self.chat.render(self.messages, self.tools)
        opening = self.chat.tokens(rendered)
        if self.record.turns >= limits.max_turns or len(opening) >= limits.max_model_len or spent >= limits.max_tokens:
            self.record.finish_reason = "length"
            return False
        self.record.closed.append(self.seq)
        self.carried += sum(r for _, r in self.steps)
        self.steps = []
        self.seq = Sequence(opening=opening, rendered=rendered)
        return True

    def recording(self) -> Recording:
        """The episode as it ended: its last sequence (a closed one when no turn followed the
        split), with the closed sequences' rewards at its last token."""
        record = self.record
        if record.closed and not self.seq.tokens:
            self.seq = record.closed.pop()
        if self.carried and self.seq.tokens:
            self.steps.append((len(self.seq.tokens) - 1, self.carried))
        record.last, record.process_rewards = self.seq, self.steps
        return record


class _EnvFailed(Exception):
    """The environment raised or timed out; the episode ends unscorable."""


async def _bounded(call: Awaitable[Any], timeout_s: float, what: str) -> Any:
    """The environment's `call` within `timeout_s` of its own time (tools it runs are bounded by
    theirs and not counted: `tools.STEP_LIMIT`)."""
    try:
        async with asyncio.timeout(timeout_s) as limit:
            token = STEP_LIMIT.set(limit)
            try:
                return await call
            finally:
                STEP_LIMIT.reset(token)
    except TimeoutError:
        raise _EnvFailed(f"environment: {what} timed out after {timeout_s:g} s") from None
    except (Exception, SystemExit) as err:  # the environment's bug (or exit) ends its episode, not the run
        raise _EnvFailed(f"environment: {what} {raised(err)}") from err


def _opening(messages: Any) -> list[Message]:
    """`reset`'s result, checked: a list of `Message`s."""
    if not isinstance(messages, (list, tuple)) or not all(isinstance(m, Message) for m in messages):
        raise _EnvFailed(f"environment: reset returned {shown(messages)}, expected a list of Message")
    return list(messages)


def _answer(result: Any) -> EnvStep:
    """`step`'s result, checked: an `EnvStep` whose reward is None or a finite number (never a
    string taken for a number, never NaN)."""
    if not isinstance(result, EnvStep):
        raise _EnvFailed(f"environment: step returned {shown(result)}, expected an EnvStep")
    if not isinstance(result.messages, (list, tuple)) or not all(isinstance(m, Message) for m in result.messages):
        raise _EnvFailed(f"environment: step returned messages {shown(result.messages)}, expected a list of Message")
    if result.reward is None:
        return result
    reward = finite(result.reward)
    if reward is None:
        raise _EnvFailed(f"environment: step returned reward {shown(result.reward)}, expected a finite number or None")
    return msgspec.structs.replace(result, reward=reward)


async def _close(env: Environment, timeout_s: float) -> None:
    """Close the episode's environment (its optional `aclose`), whatever ended it, within
    `timeout_s`: a close that fails or hangs is logged and left behind, never holding its group."""
    close = getattr(env, "aclose", None)  # optional in the user's Environment
    if close is None:
        return
    try:
        await asyncio.wait_for(close(), timeout_s)
    except TimeoutError:
        log.warning("environment: aclose did not return within %g s (env.step_timeout_s); left behind", timeout_s)
    except Exception as err:
        log.warning("environment: aclose raised %s: %s", type(err).__name__, err)


async def open_environment(factory: EnvFactory, timeout_s: float) -> Environment:
    """A new episode's environment from `factory`. A coroutine function (an OpenEnv source) may
    wait there for a free session: that wait is not the environment's time (no step timeout
    applies); it is bounded by the episodes holding the sessions, whose every call is. Any other
    (a class, a function: the user's code) runs on a guest thread within `timeout_s`."""
    if not isinstance(factory, type) and is_async(factory):
        return await factory()  # type: ignore[misc]
    env = await guest.call(factory, timeout_s=timeout_s, name=f"{name_of(factory)}()")
    if inspect.isawaitable(env):
        env = await env
    return env


class BuildFailed(Exception):
    """The user's class or function could not make an environment; the message says why."""


async def construct(factory: EnvFactory, made: str, timeout_s: float) -> Environment:
    """`open_environment`, its failure a `BuildFailed` naming `made` (how messages name the call:
    `Flaky()`): the caller decides whether that fails an episode or refuses the run."""
    try:
        return await open_environment(factory, timeout_s)
    except TimeoutError:
        raise BuildFailed(f"{made} timed out after {timeout_s:g} s (env.step_timeout_s)") from None
    except Exception as err:  # the user's constructor
        raise BuildFailed(f"{made} {raised(err)}") from None


def episode_score(sample: Sample) -> Scored:
    """What an episode earned from its environment: the sum of its turns' rewards as the part
    `env` (with each turn's reward as a process reward), or why it failed."""
    if sample.unscorable is not None:
        return Scored(None, sample.unscorable)
    if not sample.process_rewards:
        return Scored(None)
    total = sum(r for _, r in sample.process_rewards)
    return Scored(total, None, {sample.env_reward: total}, list(sample.process_rewards))


def load_environment(name: str, *, tool_timeout_s: float = 5.0) -> EnvFactory:
    """The factory `env.name` names: `calculator`, `retry`, or `module:attribute` (a class or a
    function of no arguments returning an `Environment`)."""
    if name == "calculator":
        from rollflow.envs.calculator import CalculatorEnv

        return lambda: CalculatorEnv(tool_timeout_s=tool_timeout_s)
    if name == "retry":
        from rollflow.envs.retry import RetryEnv

        return RetryEnv
    if ":" not in name:
        raise ConfigError(f"env.name: expected `calculator`, `retry` or 'module:attribute', got {name!r}")
    return load_function(name, "env.name")


class EnvironmentEpisodes(EpisodeSource):
    """Step-wise environments as a source of episodes: a new environment from `factory` for each
    (a coroutine factory, an OpenEnv source, may wait there for a session), played by
    `run_episode` under `settings`' limits. A factory that holds something for the run (`Served`)
    is started and closed with the source."""

    def __init__(self, factory: EnvFactory, settings: EpisodeConfig) -> None:
        self.factory = factory
        self.settings = settings

    async def start(self) -> None:
        """Start a factory that holds something for the run; build one environment of any other
        (the user's class or function) once, so one that cannot be built is refused in one line."""
        if isinstance(self.factory, Served):
            await self.factory.start()
            return
        if is_async(self.factory):
            return
        named = isinstance(self.settings, ToolEnvConfig) and self.settings.name
        timeout_s = self.settings.step_timeout_s
        try:
            env = await construct(self.factory, self._made, timeout_s)
        except BuildFailed as err:
            raise ConfigError(f"{'env.name' if named else 'env'}: {err}") from None
        await _close(env, timeout_s)

    @property
    def _made(self) -> str:
        """How messages name making one environment: `Class()`."""
        return f"{getattr(self.factory, '__name__', type(self.factory).__name__)}()"

    async def aclose(self) -> None:
        if isinstance(self.factory, Served):
            await self.factory.aclose()

    async def play(
        self, prompt: Prompt, *, group_id: str, index: int, generate: GenerateTurn, context: EpisodeContext
    ) -> Sample:
        limits = context.limits(self.settings)
        try:
            env = await construct(self.factory, self._made, limits.step_timeout_s)
        except BuildFailed as err:  # the environment's constructor fails its episode, not the run
            reason = f"environment: {err}"
            return failed_episode(prompt, context.sampling, group_id=group_id, index=index, reason=reason)
        return await run_episode(
            env, prompt, context.sampling, generate, context.chat, group_id=group_id, index=index, limits=limits
        )


def tool_episodes(settings: ToolEnvConfig, config: Config) -> EnvironmentEpisodes:
    """`kind = "tool"`: the environment `name` names (ConfigError when it names none: with
    `env=` passed in Python, the source is made there)."""
    if not settings.name:
        raise ConfigError('env.name: kind = "tool" needs the environment: `calculator`, `retry` or "module:Class"')
    return EnvironmentEpisodes(load_environment(settings.name, tool_timeout_s=settings.tool_timeout_s), settings)
