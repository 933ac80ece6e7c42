"""Rollout against the deterministic fake engine: versions, partial modes, cancellation."""

from __future__ import annotations

import asyncio

import pytest

from rollflow.engine import spans_to_versions
from rollflow.records import Prompt, SamplingSpec
from rollflow.rollout import rollout
from rollflow.testing import FakeEngine, context_state, fake_token, mix

PROMPT = Prompt(id="p0", token_ids=[5, 6, 7])
SPEC = SamplingSpec(max_tokens=40)


def replay(prompt: list[int], tokens: list[int], versions: list[int]) -> tuple[list[int], list[float]]:
    """What the fake model produces token by token, given each token's version."""
    state, out, logprobs = context_state(prompt), [], []
    for version in versions:
        token, logprob = fake_token(state, version, 1000)
        out.append(token)
        logprobs.append(logprob)
        state = mix(state, token)
    return out, logprobs


async def run_with_update(partial: str, after: int = 10):
    engine = FakeEngine(token_delay=0.001)
    task = asyncio.create_task(rollout(engine, PROMPT, SPEC, group_id="g", index=0, partial=partial))
    while engine.tokens_generated < after:
        await asyncio.sleep(0.001)
    await engine.update_weights({}, partial=partial)
    return await asyncio.wait_for(task, 10)


@pytest.mark.timeout(30)
async def test_keep_mode_labels_every_token_with_the_weights_that_made_it():
    sample = await run_with_update("keep")
    k = sample.versions.index(1)
    assert 10 <= k < 40 and sample.versions == [0] * k + [1] * (40 - k)
    tokens, logprobs = replay(PROMPT.token_ids, sample.completion_token_ids, sample.versions)
    assert sample.completion_token_ids == tokens and sample.logprobs == logprobs
    assert sample.interruptions == 0 and sample.finish_reason == "length"


@pytest.mark.timeout(30)
async def test_resume_mode_keeps_prefix_and_continues():
    sample = await run_with_update("resume")
    assert sample.interruptions == 1
    k = sample.versions.index(1)
    assert sample.versions == [0] * k + [1] * (40 - k)
    tokens, _ = replay(PROMPT.token_ids, sample.completion_token_ids, sample.versions)
    assert sample.completion_token_ids == tokens
    assert len(sample.logprobs) == len(sample.loss_mask) == 40


@pytest.mark.timeout(30)
async def test_restart_mode_discards_the_prefix():
    sample = await run_with_update("restart")
    assert sample.interruptions == 1 and sample.versions == [1] * 40
    assert sample.completion_token_ids == replay(PROMPT.token_ids, [], [1] * 40)[0]


@pytest.mark.timeout(30)
async def test_stop_before_max_tokens_and_cancellation_aborts():
    engine = FakeEngine(length_fn=lambda prompt: 3)
    sample = await rollout(engine, PROMPT, SPEC, group_id="g", index=1)
    assert sample.finish_reason == "stop" and len(sample.completion_token_ids) == 4
    slow = FakeEngine(token_delay=0.01)
    task = asyncio.create_task(rollout(slow, PROMPT, SPEC, group_id="g", index=2))
    while slow.num_live == 0:
        await asyncio.sleep(0.001)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert slow.num_live == 0


def test_spans_to_versions_checks_coverage():
    assert spans_to_versions([(3, 0, 2), (4, 2, 5)], 5) == [3, 3, 4, 4, 4]
    with pytest.raises(ValueError, match="not contiguous"):
        spans_to_versions([(3, 0, 2), (4, 3, 5)], 5)
    with pytest.raises(ValueError, match="cover 2 tokens"):
        spans_to_versions([(3, 0, 2)], 5)


class SeedRecorder(FakeEngine):
    """A fake engine that remembers the seed each request asked for."""

    def __init__(self) -> None:
        super().__init__()
        self.seeds: dict[str, int | None] = {}

    async def stream(self, request_id, prompt_token_ids, sampling, *, deltas=True):
        self.seeds[request_id] = sampling.seed
        async for out in super().stream(request_id, prompt_token_ids, sampling, deltas=deltas):
            yield out


async def test_every_sample_of_a_run_draws_with_its_own_seed_and_a_rerun_with_the_same_ones(tmp_path, run_fake):
    first, again = SeedRecorder(), SeedRecorder()
    await run_fake(tmp_path / "a", first, max_steps=3)
    await run_fake(tmp_path / "b", again, max_steps=3)
    seeds = [s for s in first.seeds.values()]
    assert None not in seeds and len(set(seeds)) == len(seeds) == len(first.seeds) >= 3 * 4 * 4
    assert first.seeds == again.seeds  # a request's seed depends on the run's seed and the sample alone
    assert all(0 <= s < 2**31 for s in seeds)


def test_a_request_seed_names_its_sample_and_the_run_seed():
    from rollflow.rollout import request_seed

    base = request_seed(0, "arithmetic-0-5", "g3", 1)
    assert base == request_seed(0, "arithmetic-0-5", "g3", 1)
    others = {request_seed(1, "arithmetic-0-5", "g3", 1), request_seed(0, "arithmetic-0-6", "g3", 1),
              request_seed(0, "arithmetic-0-5", "g4", 1), request_seed(0, "arithmetic-0-5", "g3", 2)}  # fmt: skip
    assert base not in others and len(others) == 4
