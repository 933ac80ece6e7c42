"""Scoring: from a finished sample's text to a reward, or an explicit reason it has none.

Built-in rewards: `verifier` (the prompt's task checker: 1.0 correct, 0.0 wrong) and `digits`
(the fraction of the completion's characters that are digits — a trivially learnable signal for
smoke tests of the training loop). A reward that cannot be computed is *unscorable* with a
reason, never a silent 0. Remote reward servers and reward functions with the TRL signature are
not here yet.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal

from rollflow.records import Prompt
from rollflow.tasks import verify

RewardName = Literal["verifier", "digits"]


def digits_reward(text: str) -> float:
    """Fraction of characters that are digits (0.0 for an empty completion)."""
    return sum(c.isdigit() for c in text) / len(text) if text else 0.0


def make_scorer(name: RewardName) -> Callable[[Prompt, str], tuple[float | None, str | None]]:
    """A function (prompt, completion text) -> (reward, None) or (None, reason)."""

    def score(prompt: Prompt, text: str) -> tuple[float | None, str | None]:
        try:
            if name == "digits":
                value = digits_reward(text)
            else:
                value = verify(prompt.task, text, prompt.answer, prompt.metadata)
        except Exception as err:  # a broken verifier makes the sample unscorable, not 0
            return None, f"reward error: {type(err).__name__}: {err}"
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            return None, f"reward is not a finite number: {value!r}"
        return float(value), None

    return score
