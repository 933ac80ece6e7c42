"""A generated group's samples scored and given advantages, or why the group is dropped.

`score_group`: rewards (and teacher log-probs) beside generation, DAPO's soft overlong penalty,
group-relative and process advantages, dynamic sampling's filter; the result is the `Group` to
buffer or `Dropped` with its reason (a group none of whose samples could be scored has failed).
`InFlight` is a group from its launch until it is buffered or dropped. This module does not
generate, drop or release admission room (`controller.producer` does all three).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import msgspec

from rollflow.advantage import group_advantages, overlong_penalty, process_advantages
from rollflow.config import Config
from rollflow.envs import episode_score
from rollflow.episodes import EpisodeSource
from rollflow.records import Group, Prompt, Sample
from rollflow.rollout import Progress
from rollflow.scoring import Scored, Scorer
from rollflow.trace import Trace


@dataclass(eq=False)
class InFlight:
    """A group from launch until it is buffered or dropped."""

    prompt: Prompt
    group_id: str
    progress: list[Progress]
    """Each sample's tokens so far (what a checkpoint saves)."""
    task: asyncio.Task[None] | None = None
    generating: bool = True
    """Still streaming (False while it is scored)."""
    settled: bool = False
    """In the buffer, or dropped with a reason. A group cancelled before it could say which
    stays registered, and the run's end drops it."""


class Dropped(msgspec.Struct, frozen=True):
    """A scored group that will not be trained, and why."""

    reason: str
    failed: bool
    """None of its samples could be scored (the stop rule counts it); else it was filtered by
    dynamic sampling (it teaches nothing)."""


@dataclass(frozen=True)
class Scoring:
    """What scoring a group needs: the run's settings, its rewards, the tokenizer that decodes
    completions for them, the distillation teacher (and the thread it runs on), the trace."""

    config: Config
    scorer: Scorer
    tokenizer: Any
    teacher: Any
    teacher_thread: ThreadPoolExecutor
    trace: Trace
    clock: Callable[[], float]
    episodes: EpisodeSource | None = None
    """The run's episode source (it may add columns for the reward functions)."""


async def score_group(scoring: Scoring, prompt: Prompt, samples: list[Sample]) -> Group | Dropped:
    """Rewards (and teacher log-probs) of a generated group, then advantages: the group to
    buffer, or why it is dropped (none of its samples could be scored, or it teaches nothing).
    Cancellation propagates (the caller decides what the group becomes)."""
    cfg = scoring.config
    began = scoring.clock()
    texts = [scoring.tokenizer.decode(s.completion_token_ids, skip_special_tokens=True) for s in samples]
    prior = [episode_score(s) for s in samples] if cfg.env is not None else None
    extra = scoring.episodes.columns(samples) if scoring.episodes is not None else None
    results = await scoring.scorer.score(prompt, texts, [s.completion_token_ids for s in samples], prior, extra)
    if scoring.teacher is not None:
        samples, results = await _teacher_logprobs(scoring, samples, results)
    scored = [
        msgspec.structs.replace(
            sample, reward=r.reward, unscorable=r.reason, reward_parts=r.parts, process_rewards=r.steps
        )
        for sample, r in zip(samples, results, strict=True)
    ]
    if cfg.rollout.overlong == "soft":
        scored = [_length_penalised(cfg, s) for s in scored]
    scoring.trace.span("reward", "reward", began, scoring.clock(), prompt=prompt.id, rewards=[s.reward for s in scored])
    if all(s.reward is None for s in scored):
        return Dropped(f"unscorable: {scored[0].unscorable}", failed=True)
    adv = group_advantages([s.reward for s in scored], estimator=cfg.loss.advantage, scale_std=cfg.loss.scale_std)
    credit: list[list[float] | None] = []
    if cfg.scoring.process_coef and any(s.process_rewards for s in scored):
        per_token = process_advantages(
            [s.process_rewards if s.reward is not None else None for s in scored],
            [s.num_tokens for s in scored],
            scale_std=cfg.loss.scale_std,
        )
        credit = [None if t is None else [cfg.scoring.process_coef * a for a in t] for t in per_token]
    if cfg.rollout.filter_equal_rewards and _teaches_nothing(scored, credit):
        # Not a failure: early on, most groups of a hard task are; only the stall time limit counts it.
        return Dropped("filtered: equal rewards", failed=False)
    return Group(prompt=prompt, samples=scored, advantages=adv.advantages, token_advantages=credit)


def _length_penalised(cfg: Config, sample: Sample) -> Sample:
    """The sample's reward with DAPO's soft overlong penalty added (as the part `overlong`)."""
    if sample.reward is None:
        return sample
    penalty = overlong_penalty(sample.num_tokens, cfg.completion_budget, cfg.rollout.overlong_buffer)
    parts: dict[str, float] = dict(sample.reward_parts or {cfg.run.reward: sample.reward})
    parts["overlong"] = penalty
    return msgspec.structs.replace(sample, reward=sample.reward + penalty, reward_parts=parts)


async def _teacher_logprobs(
    scoring: Scoring, samples: list[Sample], results: list[Scored]
) -> tuple[list[Sample], list[Scored]]:
    """Attach the teacher's log-probs of every sampled token; a failure makes the samples
    unscorable with the reason."""
    loop = asyncio.get_running_loop()
    try:
        logprobs = await loop.run_in_executor(scoring.teacher_thread, scoring.teacher, samples)
    except Exception as err:  # the teacher is a scoring stage: its failure is a reason, not a crash
        reason = f"teacher: raised {type(err).__name__}: {err}"
        return samples, [Scored(None, r.reason or reason, r.parts) for r in results]
    return [msgspec.structs.replace(s, teacher_logprobs=lp) for s, lp in zip(samples, logprobs, strict=True)], results


def _teaches_nothing(scored: list[Sample], credit: list[list[float] | None]) -> bool:
    """Every scored reward is the same and no token has process credit: a zero gradient."""
    rewards = {s.reward for s in scored if s.reward is not None}
    return len(rewards) <= 1 and not any(a for c in credit if c is not None for a in c)
