"""A generated group's samples scored, given advantages, and buffered, or dropped with the reason.

Mixed into `Producer` (which provides what is declared here, and `_drop` / `_fail`): rewards
(and teacher log-probs) beside generation, DAPO's soft overlong penalty, group-relative and
process advantages, dynamic sampling's filter; a group none of whose samples could be scored is
dropped as failed and gives its admission room back. `InFlight` is a group from its launch until
it is buffered or dropped. This module does not generate (`controller.producer` does).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import msgspec

from rollflow.advantage import group_advantages, overlong_penalty, process_advantages
from rollflow.buffer import Admission, GroupBuffer
from rollflow.config import Config
from rollflow.controller.accounting import Accounting
from rollflow.controller.stall import StallWatch
from rollflow.envs import episode_score
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


class GroupScoring:
    """The scoring stage of the producer, mixed into `Producer`."""

    config: Config
    admission: Admission
    buffer: GroupBuffer
    scorer: Scorer
    accounting: Accounting
    tokenizer: Any
    trace: Trace
    clock: Any
    episodes: bool
    teacher: Any
    stall: StallWatch
    filtered: int
    _teacher_thread: ThreadPoolExecutor

    def _drop(self, entry: InFlight, reason: str, *, abandoned: int = 0) -> None:
        raise NotImplementedError

    def _fail(self, entry: InFlight, reason: str) -> None:
        raise NotImplementedError

    async def _score(self, entry: InFlight, samples: list[Sample]) -> None:
        """Rewards (and teacher log-probs), then advantages; the group goes into the buffer, or
        is dropped when none of its samples could be scored."""
        cfg, prompt = self.config, entry.prompt
        began = self.clock()
        texts = [self.tokenizer.decode(s.completion_token_ids, skip_special_tokens=True) for s in samples]
        prior = [episode_score(s) for s in samples] if self.episodes else None
        try:
            results = await self.scorer.score(prompt, texts, [s.completion_token_ids for s in samples], prior)
            if self.teacher is not None:
                samples, results = await self._teacher_logprobs(samples, results)
        except asyncio.CancelledError:
            if not self.accounting.pending_held:
                self._drop(entry, "run ended: being scored", abandoned=len(samples))
            raise
        scored = [
            msgspec.structs.replace(
                sample, reward=r.reward, unscorable=r.reason, reward_parts=r.parts, process_rewards=r.steps
            )
            for sample, r in zip(samples, results, strict=True)
        ]
        if cfg.rollout.overlong == "soft":
            scored = [self._length_penalised(s) for s in scored]
        self.trace.span("reward", "reward", began, self.clock(), prompt=prompt.id, rewards=[s.reward for s in scored])
        if all(s.reward is None for s in scored):
            self._fail(entry, f"unscorable: {scored[0].unscorable}")
            await self.admission.release(len(scored))
            return
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
            self._drop(entry, "filtered: equal rewards")
            self.stall.filtered("filtered: equal rewards")
            self.filtered += 1
            await self.admission.release(len(scored))
            return
        await self.buffer.put(Group(prompt=prompt, samples=scored, advantages=adv.advantages, token_advantages=credit))
        entry.settled = True
        self.stall.buffered()

    def _length_penalised(self, sample: Sample) -> Sample:
        """The sample's reward with DAPO's soft overlong penalty added (as the part `overlong`)."""
        if sample.reward is None:
            return sample
        cfg = self.config
        budget = cfg.env.max_tokens if self.episodes else cfg.sampling.max_tokens
        penalty = overlong_penalty(sample.num_tokens, budget, cfg.rollout.overlong_buffer)
        parts: dict[str, float] = dict(sample.reward_parts or {cfg.run.reward: sample.reward})
        parts["overlong"] = penalty
        return msgspec.structs.replace(sample, reward=sample.reward + penalty, reward_parts=parts)

    async def _teacher_logprobs(
        self, samples: list[Sample], results: list[Scored]
    ) -> tuple[list[Sample], list[Scored]]:
        """Attach the teacher's log-probs of every sampled token; a failure makes the samples
        unscorable with the reason."""
        loop = asyncio.get_running_loop()
        try:
            logprobs = await loop.run_in_executor(self._teacher_thread, self.teacher, samples)
        except Exception as err:  # the teacher is a scoring stage: its failure is a reason, not a crash
            reason = f"teacher: raised {type(err).__name__}: {err}"
            return samples, [Scored(None, r.reason or reason, r.parts) for r in results]
        return [
            msgspec.structs.replace(s, teacher_logprobs=lp) for s, lp in zip(samples, logprobs, strict=True)
        ], results


def _teaches_nothing(scored: list[Sample], credit: list[list[float] | None]) -> bool:
    """Every scored reward is the same and no token has process credit: a zero gradient."""
    rewards = {s.reward for s in scored if s.reward is not None}
    return len(rewards) <= 1 and not any(a for c in credit if c is not None for a in c)
