"""A dead engine is replaced in place: in-flight samples continue from what they had, with exact
versions, and every prompt is trained once (fake engine and trainer)."""

from __future__ import annotations

import asyncio

import pytest

from rollflow.config import load_config
from rollflow.controller import Controller
from rollflow.controller.setup import Given
from rollflow.errors import EngineDeadError, WeightSyncError
from rollflow.ledger import summarize
from rollflow.testing import FakeEngine, FakeTokenizer, FakeTrainer, NullTransport

MAX_TOKENS = 24


class MortalEngine(FakeEngine):
    """A fake engine whose process dies after producing `die_after` tokens, mid-stream: every
    running request then fails, carrying what it had produced, and every later call fails too."""

    def __init__(self, die_after: int | None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.die_after = die_after
        self.died_at_version: int | None = None
        self.died_with: dict[str, int] = {}
        """Request id -> tokens it had when the engine died."""

    @property
    def dead(self) -> bool:
        return self.died_at_version is not None

    async def _step_wait(self, request_id: str, context_tokens: int) -> None:
        await super()._step_wait(request_id, context_tokens)
        if not self.dead and self.die_after is not None and self.tokens_generated >= self.die_after:
            self.died_at_version = self.version
        if self.dead:
            partial = self.partial(request_id)
            self.died_with[request_id] = len(partial.token_ids) if partial else 0
            raise EngineDeadError("fake engine process died", partial=partial)

    async def update_weights_with(self, load, **kwargs) -> int:
        if self.dead:
            raise EngineDeadError("fake engine process died")
        return await super().update_weights_with(load, **kwargs)


def make(tmp_path, engines: list[MortalEngine], die_after: list[int | None], kinds=(), **settings):
    """A controller on fake engines: engine n dies after `die_after[n]` tokens and is of class
    `kinds[n]` (default `MortalEngine`)."""
    overrides = ["run.reward=digits", f"sampling.max_tokens={MAX_TOKENS}", "observe.sinks=[]", "run.max_steps=6"]
    overrides += [f"{key.replace('__', '.')}={value}" for key, value in settings.items()]

    def new_engine() -> MortalEngine:
        kind = kinds[len(engines)] if len(engines) < len(kinds) else MortalEngine
        engines.append(kind(die_after[len(engines)], token_delay=0.002))
        return engines[-1]

    return Controller(
        load_config(preset="tiny", overrides=overrides),
        tmp_path,
        given=Given(
            engine=new_engine(),
            engine_factory=new_engine,
            trainer=FakeTrainer(step_s=0.05),
            transport=NullTransport(),
            tokenizer=FakeTokenizer(),
        ),
    )


async def test_a_dead_engine_is_restarted_and_samples_continue_where_they_were(
    tmp_path, record_groups, assert_versions_exact
):
    engines: list[MortalEngine] = []
    groups = record_groups
    # 16 samples of 24 tokens per step: the first engine dies in the middle of the third step's work.
    controller = make(tmp_path, engines, die_after=[2 * 16 * MAX_TOKENS + 100, None])
    result = await asyncio.wait_for(controller.run(), 60)
    assert result.steps == 6 and controller.engine_restarts == 1 and len(engines) == 2
    assert result.metrics[-1]["engine_restarts"] == 1
    assert engines[1].version == 6  # the replacement got the trainer's weights, then every later version
    dead_at = engines[0].died_at_version
    cut = {rid.split("#")[0]: n for rid, n in engines[0].died_with.items() if n > 0}
    assert cut, "some requests should have died mid-generation"
    continued = 0
    for group in groups:
        for sample in group.samples:
            # Every token, before and after the death, is what its labelled version computes.
            assert_versions_exact(
                sample.prompt_token_ids, sample.completion_token_ids, sample.versions
            )
            n = cut.get(f"{sample.group_id}/{sample.index}")
            if n and len(sample.versions) > n:
                continued += 1
                assert max(sample.versions[:n]) <= dead_at <= min(sample.versions[n:])
    assert continued > 0
    summary = summarize(tmp_path)
    assert summary.ok and summary.trained + sum(summary.dropped.values()) == controller.producer.group_seq


async def test_an_engine_that_keeps_dying_stops_the_run_with_a_clear_error(tmp_path):
    engines: list[MortalEngine] = []
    controller = make(tmp_path, engines, die_after=[500, 500], engine__max_restarts=1)
    with pytest.raises(EngineDeadError, match=r"not restarted \(1 of engine.max_restarts = 1\)"):
        await asyncio.wait_for(controller.run(), 60)
    assert len(engines) == 2
    summary = summarize(tmp_path)  # everything started is still accounted for, once
    assert summary.duplicates == [] and summary.trained + sum(summary.dropped.values()) == controller.producer.group_seq


class UnloadableEngine(MortalEngine):
    """Starts, but cannot take weights: a replacement whose preparation fails."""

    closed = False

    async def update_weights(self, weights, **kwargs) -> int:
        raise WeightSyncError("fake weight load failed")

    async def aclose(self) -> None:
        self.closed = True
        await super().aclose()


async def test_a_replacement_that_cannot_take_the_weights_is_closed_not_leaked(tmp_path):
    engines: list[MortalEngine] = []
    controller = make(
        tmp_path, engines, die_after=[2 * 16 * MAX_TOKENS + 100, None], kinds=(MortalEngine, UnloadableEngine)
    )
    with pytest.raises(WeightSyncError, match="fake weight load failed"):
        await asyncio.wait_for(controller.run(), 60)
    assert len(engines) == 2 and engines[1].closed
    summary = summarize(tmp_path)
    assert summary.duplicates == [] and summary.trained + sum(summary.dropped.values()) == controller.producer.group_seq
