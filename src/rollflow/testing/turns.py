"""Scripted model turns for episode tests: the text each turn says, "sampled" deterministically.

`ScriptedTurns` is a `GenerateTurn` (what an episode calls for each model turn) that returns the
next scripted text as tokens of the real tokenizer, ending with its end-of-turn token (cut at the
turn's `max_tokens`, ending in `length`, as an engine does), each with
log-prob -0.1 × its position and the version in `version`; it remembers the token ids each turn
was asked to continue (`seen`). Tests of environments and agents use it where the mechanics, not
a model, are under test.
"""

from __future__ import annotations

import asyncio
from typing import Any

from rollflow.episodes import Recording, Sequence, sample_of
from rollflow.records import Prompt, Sample, SamplingSpec


class ScriptedTurns:
    """The model's turns, in order."""

    def __init__(self, chat: Any, turns: list[str], *, version: int = 0) -> None:
        """`chat`: a `rollflow.envs.ChatFormat` (its tokenizer turns each text into tokens)."""
        self.chat, self.turns, self.version = chat, list(turns), version
        self.seen: list[list[int]] = []
        self.specs: list[SamplingSpec] = []
        """What each turn was asked with (its stop sequences are not honoured here: the turn's
        whole text comes back, as from an engine that overshot them)."""

    async def __call__(self, token_ids: list[int], spec: SamplingSpec, n: int) -> Sample:
        self.seen.append(list(token_ids))
        self.specs.append(spec)
        ids = [*self.chat.tokens(self.turns.pop(0)), self.chat.tokenizer.eos_token_id]
        finish = "length" if len(ids) > spec.max_tokens else "stop"  # cut at the budget, as an engine does
        ids = ids[: spec.max_tokens]
        await asyncio.sleep(0)  # a turn yields to the loop, as a streamed one does
        logprobs, versions = [-0.1 * i for i in range(len(ids))], [self.version] * len(ids)
        turn = Sequence(opening=token_ids, tokens=ids, logprobs=logprobs, versions=versions, mask=[1] * len(ids))
        recording = Recording(last=turn, finish_reason=finish)
        return sample_of(Prompt(id="p", token_ids=token_ids), recording, group_id="g", index=0, sampling=spec)
