"""Scored groups -> the `TrainBatch` one optimizer step consumes, and that batch's metrics.

`build_batch` turns a step's groups into its `TrainBatch` (tokens too stale for `max_lag`
withheld from the loss) and its metrics; `train_sample` turns one scored `Sample` and its
advantage into what the trainer consumes. Pure functions: this module does not train, schedule
or talk to other ranks (`rollflow.ranks` sends batches to them).
"""

from __future__ import annotations

from typing import Any

import msgspec

from rollflow.buffer import lags, withhold_stale
from rollflow.metrics import histogram
from rollflow.records import Group, Sample, Segment, TrainBatch, TrainSample


def train_sample(
    sample: Sample,
    advantage: float,
    loss_mask: list[int] | None = None,
    *,
    distill_coef: float = 0.0,
    distill_baseline: float = 0.0,
    token_extra: list[float] | None = None,
) -> TrainSample:
    """What the trainer needs from one sample (`loss_mask` overrides the sample's, e.g. to
    withhold tokens that are too stale). With teacher log-probs and `distill_coef`, every token's
    advantage adds the reverse-KL term `distill_coef × (teacher − behaviour − distill_baseline)`;
    `token_extra` (process-reward credit) is added per token as given."""
    token_advantages = None
    if token_extra is not None:
        token_advantages = [advantage + extra for extra in token_extra]
    if sample.teacher_logprobs is not None and distill_coef:
        base = token_advantages or [advantage] * sample.num_tokens
        token_advantages = [
            a + distill_coef * (t - b - distill_baseline)
            for a, t, b in zip(base, sample.teacher_logprobs, sample.logprobs, strict=True)
        ]
    return TrainSample(
        input_ids=sample.prompt_token_ids + sample.completion_token_ids,
        prompt_len=len(sample.prompt_token_ids),
        logprobs=sample.logprobs,
        loss_mask=loss_mask if loss_mask is not None else sample.loss_mask,
        advantage=advantage,
        token_advantages=token_advantages,
        temperature=sample.sampling.temperature,
        top_k=sample.sampling.top_k,
        top_p=sample.sampling.top_p,
    )


def build_batch(
    step: int,
    groups: list[Group],
    *,
    max_lag: int,
    max_tokens: int,
    reward_name: str,
    distill_coef: float = 0.0,
    filter_overlong: bool = False,
) -> tuple[TrainBatch, dict[str, Any]]:
    """The batch of optimizer step `step` from its groups, and the batch's metrics.

    Unscorable samples stay out (counted by reason); rewards are summarised in total and per
    reward function (`reward_name` names a sample scored without parts); tokens whose lag exceeds `max_lag` are
    withheld from the loss (`buffer.withhold_stale`) while their sample keeps its advantage.
    Samples with teacher log-probs get per-token reverse-KL advantages (`train_sample`) and the
    batch's `teacher_kl` (mean of behaviour − teacher log-prob over their tokens).
    `filter_overlong`: samples cut at the token budget keep their place (and their reward in the
    baseline) but none of their tokens is in the loss (`overlong_filtered`).
    """
    tally = _Tally(step, max_lag)
    samples: list[TrainSample] = []
    for group in groups:
        baseline = _kl_baseline(group)
        extras = group.token_advantages or [None] * len(group.samples)
        for sample, advantage, extra in zip(group.samples, group.advantages, extras, strict=True):
            if not tally.scored(sample, reward_name):
                continue
            cut = filter_overlong and sample.finish_reason == "length"
            tally.overlong += cut
            # An agent's earlier sequences (history rewritten) train with the episode's advantage.
            for part in [*(_segment_sample(sample, s) for s in sample.segments), sample]:
                mask = tally.withhold(part, cut)
                token_extra = extra if part is sample else None
                samples.append(
                    train_sample(
                        part,
                        advantage,
                        mask,
                        distill_coef=distill_coef,
                        distill_baseline=baseline,
                        token_extra=token_extra,
                    )
                )
    return TrainBatch(step=step, samples=samples, max_tokens=max_tokens), tally.stats(samples)


def _kl_baseline(group: Group) -> float:
    """Baseline of the reverse-KL term: its mean over the group's tokens (lowers the variance)."""
    gaps = [
        t - b
        for s in group.samples
        if s.reward is not None and s.teacher_logprobs is not None
        for t, b in zip(s.teacher_logprobs, s.logprobs, strict=True)
    ]
    return sum(gaps) / len(gaps) if gaps else 0.0


def mixes_versions(sample: Sample) -> bool:
    """Whether the model's tokens of `sample` (its split-off sequences' too) came from more than
    one policy version: a weight update landed while it generated, between two turns or within one."""
    made = {v for v, m in zip(sample.versions, sample.loss_mask, strict=True) if m}
    for part in sample.segments:
        made |= {v for v, m in zip(part.versions, part.loss_mask, strict=True) if m}
    return len(made) > 1


class _Tally:
    """What a batch's metrics count, sample by sample (`stats` reports them)."""

    def __init__(self, step: int, max_lag: int) -> None:
        self.step, self.max_lag = step, max_lag
        self.rewards: list[float] = []
        self.turns: list[int] = []
        self.kl_terms: list[float] = []
        self.parts: dict[str, list[float]] = {}
        self.measured: dict[str, list[float]] = {}
        self.unscorable: dict[str, int] = {}
        self.budget_ends: dict[str, int] = {}
        self.all_lags: list[int] = []
        self.sample_lags: list[int] = []
        self.in_flight: list[int] = []
        self.in_queue: list[int] = []
        self.withheld = self.loss_lag_max = self.overlong = self.splits = self.off_policy = self.mixed = 0

    def scored(self, sample: Sample, reward_name: str) -> bool:
        """Count the sample; False when it is unscorable (it stays out of the batch)."""
        if sample.budget is not None:
            self.budget_ends[sample.budget] = self.budget_ends.get(sample.budget, 0) + 1
        self.off_policy += sample.made_by is not None
        self.mixed += mixes_versions(sample)
        if sample.reward is None:
            reason = sample.unscorable or "unknown"
            self.unscorable[reason] = self.unscorable.get(reason, 0) + 1
            return False
        self.rewards.append(sample.reward)
        self.turns.append(sample.turns)
        for name, value in (sample.reward_parts or {reward_name: sample.reward}).items():
            self.parts.setdefault(name, []).append(value)
        for name, value in sample.env_metrics.items():
            self.measured.setdefault(name, []).append(value)
        self.splits += len(sample.segments)
        if sample.done_version is not None and sample.versions:
            # The sample's lag by cause: the policy moved while it generated, then it waited.
            self.in_flight.append(max(0, sample.done_version - min(sample.versions)))
            self.in_queue.append(max(0, self.step - sample.done_version))
        if sample.teacher_logprobs is not None:
            self.kl_terms += [b - t for b, t in zip(sample.logprobs, sample.teacher_logprobs, strict=True)]
        return True

    def withhold(self, part: Sample, cut: bool) -> list[int]:
        """`part`'s loss mask with its too-stale tokens withheld (all of them when `cut`), its lags counted."""
        mask, n = withhold_stale(part.versions, part.loss_mask, self.step, self.max_lag)
        self.withheld += n
        if cut:
            mask = [0] * len(mask)
        token_lags = lags(part.versions, self.step)
        for lag, kept in zip(token_lags, mask, strict=True):
            if kept and lag > self.loss_lag_max:
                self.loss_lag_max = lag
        self.all_lags += token_lags
        self.sample_lags.append(max(token_lags, default=0))
        return mask

    def stats(self, samples: list[TrainSample]) -> dict[str, Any]:
        mean, std = _mean_std(self.rewards)
        all_lags, turns = self.all_lags, self.turns
        stats = {
            "reward_mean": mean,
            "reward_std": std,
            "rewards": {n: dict(zip(("mean", "std"), _mean_std(v), strict=True)) for n, v in self.parts.items()},
            "env_metrics": {name: sum(values) / len(values) for name, values in self.measured.items()},
            "budget_ends": self.budget_ends,
            "samples": len(samples),
            "tokens": sum(s.num_completion for s in samples),
            "turns_mean": sum(turns) / len(turns) if turns else 0.0,
            "lag_mean": sum(all_lags) / len(all_lags) if all_lags else 0.0,
            "lag_max": max(all_lags, default=0),
            "lag_hist": histogram(all_lags),
            "sample_lag_max": max(self.sample_lags, default=0),
            "sample_lag_hist": histogram(self.sample_lags),
            "lag_in_flight_hist": histogram(self.in_flight),
            "lag_in_queue_hist": histogram(self.in_queue),
            "withheld_tokens": self.withheld,
            "withheld_by_reason": {f"lag > {self.max_lag}": self.withheld} if self.withheld else {},
            "loss_lag_max": self.loss_lag_max,
            "unscorable": sum(self.unscorable.values()),
            "unscorable_by_reason": self.unscorable,
            "overlong_filtered": self.overlong,
            "agent_splits": self.splits,
            "off_policy_samples": self.off_policy,
            "mixed_version_samples": self.mixed,
        }
        if self.kl_terms:
            stats["teacher_kl"] = sum(self.kl_terms) / len(self.kl_terms)
            stats["teacher_gap_abs_max"] = max(abs(k) for k in self.kl_terms)
        return stats


def _segment_sample(sample: Sample, segment: Segment) -> Sample:
    """An earlier sequence of `sample` as a sample of its own (no teacher or process credit)."""
    return msgspec.structs.replace(
        sample,
        prompt_token_ids=segment.prompt_token_ids,
        completion_token_ids=segment.completion_token_ids,
        logprobs=segment.logprobs,
        versions=segment.versions,
        loss_mask=segment.loss_mask,
        teacher_logprobs=None,
        process_rewards=[],
        segments=[],
    )


def _mean_std(values: list[float]) -> tuple[float, float]:
    if not values:
        return 0.0, 0.0
    mean = sum(values) / len(values)
    return mean, (sum((v - mean) ** 2 for v in values) / len(values)) ** 0.5
