"""Group-relative advantages: pure functions from a group's rewards to per-sample advantages.

A reward of None means the sample is unscorable: it is excluded from the baseline, gets
advantage 0, and is counted. A group whose scorable rewards are all equal carries no learning
signal and gets zeros (no division by a zero std). This module knows nothing about samples,
tokens or tensors.
"""

from __future__ import annotations

import math
from typing import Literal

import msgspec

Estimator = Literal["grpo", "rloo"]

STD_EPS = 1e-6
"""Added to the group std before dividing, and the threshold below which rewards count as equal."""


class GroupAdvantages(msgspec.Struct, frozen=True):
    """Advantages of one group and what went into them."""

    advantages: list[float]
    unscorable: int
    """Samples excluded from the baseline (reward None or not finite)."""
    degenerate: bool
    """True when all scorable rewards were equal (or fewer than two were scorable)."""


def _scorable(rewards: list[float | None]) -> list[int]:
    return [i for i, r in enumerate(rewards) if r is not None and math.isfinite(r)]


def group_advantages(
    rewards: list[float | None], *, estimator: Estimator = "grpo", scale_std: bool = True
) -> GroupAdvantages:
    """Advantages for one GRPO group.

    `grpo`: reward minus the group mean, divided by the group std when `scale_std`.
    `rloo`: reward minus the mean of the *other* scorable samples (leave-one-out).
    """
    index = _scorable(rewards)
    advantages = [0.0] * len(rewards)
    values = [float(rewards[i]) for i in index]  # type: ignore[arg-type]
    unscorable = len(rewards) - len(index)
    n = len(values)
    if n < 2 or max(values) - min(values) <= STD_EPS:
        return GroupAdvantages(advantages, unscorable, True)
    mean = sum(values) / n
    if estimator == "grpo":
        centred = [v - mean for v in values]
        if scale_std:
            std = math.sqrt(sum(c * c for c in centred) / (n - 1))
            centred = [c / (std + STD_EPS) for c in centred]
    elif estimator == "rloo":
        total = sum(values)
        centred = [v - (total - v) / (n - 1) for v in values]
    else:
        raise ValueError(f"unknown advantage estimator {estimator!r}")
    for i, a in zip(index, centred, strict=True):
        advantages[i] = a
    return GroupAdvantages(advantages, unscorable, False)


def process_advantages(
    steps: list[list[tuple[int, float]] | None], lengths: list[int], *, scale_std: bool = True
) -> list[list[float] | None]:
    """Per-token advantages from process (per-step) rewards, for one group.

    `steps[i]` holds sample i's (end token index, reward) pairs, or None when the sample is
    unscorable; `lengths[i]` is its completion length. Every step reward of the group's scorable
    samples is centred on their mean (and divided by their std when `scale_std`); a token's
    advantage is the sum of the normalised rewards of the steps ending at or after it (the reward
    still to come, as in process-supervised GRPO). Unscorable samples get None; a group whose step
    rewards are all equal (or fewer than two) gets zeros.
    """
    values = [r for s in steps if s for _, r in s if math.isfinite(r)]
    out: list[list[float] | None] = [None if s is None else [0.0] * n for s, n in zip(steps, lengths, strict=True)]
    if len(values) < 2 or max(values) - min(values) <= STD_EPS:
        return out
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) if scale_std else 1.0
    for sample_steps, tokens in zip(steps, out, strict=True):
        if not sample_steps or tokens is None:
            continue
        for end, reward in sample_steps:
            if not 0 <= end < len(tokens):
                raise ValueError(f"a process reward ends at token {end}, outside the completion's {len(tokens)} tokens")
            normalised = (reward - mean) / (std + STD_EPS)
            for t in range(end + 1):  # every token up to the step's end earns it
                tokens[t] += normalised
    return out


def overlong_penalty(length: int, budget: int, buffer: int) -> float:
    """DAPO's soft overlong penalty for a completion of `length` tokens under a `budget`: 0 up to
    `budget - buffer` tokens, then falling linearly to -1 at the budget (and -1 beyond)."""
    free = budget - buffer
    if length <= free:
        return 0.0
    return max(-1.0, (free - length) / buffer)
