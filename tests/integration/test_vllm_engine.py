"""The vLLM adapter against plain transformers: tokens, log-probs, abort, weight updates."""

from __future__ import annotations

import asyncio

import pytest

from rollflow.records import Prompt, SamplingSpec
from rollflow.rollout import Progress, rollout

pytestmark = pytest.mark.integration

PROMPT = [1, 735, 202, 276, 261, 264, 277, 281, 34, 2, 202, 1, 871, 202]
GREEDY = SamplingSpec(temperature=0.0, max_tokens=24, ignore_eos=True)


def _prompt(token_ids: list[int] = PROMPT, pid: str = "p") -> Prompt:
    return Prompt(id=pid, token_ids=token_ids)


async def test_greedy_tokens_and_logprobs_match_transformers(engine, model_a):
    out = await engine.generate(PROMPT, GREEDY, "greedy-1")
    tokens, logprobs = model_a.greedy(PROMPT, GREEDY.max_tokens)
    assert out.token_ids == tokens
    assert out.finish_reason == "length"
    assert out.versions == [engine.version] * len(tokens)
    for got, want in zip(out.logprobs, logprobs, strict=True):
        assert got == pytest.approx(want, abs=1e-4)


async def test_a_stop_sequence_ends_the_request_at_the_token_that_completes_it(engine, stop_inside):
    whole = await engine.generate(PROMPT, SamplingSpec(temperature=0.0, max_tokens=48, ignore_eos=True), "whole")
    stop, n = stop_inside(whole.token_ids)
    assert n < len(whole.token_ids)
    spec = SamplingSpec(temperature=0.0, max_tokens=48, ignore_eos=True, stop=(stop,))
    out = await engine.generate(PROMPT, spec, "stopped")
    assert out.token_ids == whole.token_ids[:n] and out.finish_reason == "stop"  # nothing past it generated
    assert out.logprobs == pytest.approx(whole.logprobs[:n], abs=1e-5)


async def test_abort_ends_one_stream_and_engine_keeps_serving(engine, model_a):
    long = SamplingSpec(temperature=0.0, max_tokens=200, ignore_eos=True)
    first_tokens = asyncio.Event()

    async def consume(request_id: str):
        tokens, reason = [], None
        async for out in engine.stream(request_id, PROMPT, long):
            tokens += out.token_ids
            if request_id == "abort-b" and len(tokens) >= 2:
                first_tokens.set()
            reason = out.finish_reason or reason
        return tokens, reason

    tasks = [asyncio.create_task(consume(f"abort-{name}")) for name in "abc"]
    await first_tokens.wait()
    await engine.abort("abort-b")
    (a_tokens, a_reason), (b_tokens, b_reason), (c_tokens, c_reason) = await asyncio.gather(*tasks)
    assert b_reason == "abort" and len(b_tokens) < long.max_tokens
    assert a_reason == c_reason == "length"
    assert len(a_tokens) == len(c_tokens) == long.max_tokens
    # Still serving, and still correct.
    again = await engine.generate(PROMPT, GREEDY, "after-abort")
    assert again.token_ids == model_a.greedy(PROMPT, GREEDY.max_tokens)[0]


async def test_loading_weights_switches_greedy_output_and_back(engine_on_a, model_a, model_b):
    engine = engine_on_a
    want_a = model_a.greedy(PROMPT, GREEDY.max_tokens)[0]
    want_b = model_b.greedy(PROMPT, GREEDY.max_tokens)[0]
    assert want_a != want_b, "the two tiny models must disagree for this test to mean anything"
    before = engine.version
    assert await engine.update_weights(model_b.state_dict()) == before + 1
    out = await engine.generate(PROMPT, GREEDY, "switch-b")
    assert out.token_ids == want_b
    assert out.versions == [before + 1] * len(want_b)
    await engine.update_weights(model_a.state_dict())
    assert (await engine.generate(PROMPT, GREEDY, "switch-a")).token_ids == want_a
    assert engine.version == before + 2


LONG = 160
"""Tokens of the rollouts a weight update interrupts: long enough that an update sent after the
first few tokens lands mid-stream however fast the machine generates."""


async def _update_mid_stream(engine, model_b, partial: str, streaming):
    """Start a long greedy rollout, load model B once it has produced a few tokens."""
    version = engine.version
    task = await streaming(engine, PROMPT, f"mid-{partial}", LONG, partial=partial)
    await engine.update_weights(model_b.state_dict(), partial=partial)
    sample = await task
    return sample, version


async def test_keep_mode_versions_switch_at_the_exact_boundary(engine_on_a, model_a, model_b, streaming):
    sample, v = await _update_mid_stream(engine_on_a, model_b, "keep", streaming)
    tokens, versions = sample.completion_token_ids, sample.versions
    assert len(tokens) == LONG and sample.interruptions == 0
    k = versions.index(v + 1)
    assert 0 < k < LONG, f"update must land mid-stream, landed at {k}"
    assert versions == [v] * k + [v + 1] * (LONG - k)
    # Before the boundary: model A from the prompt. After it: model B from prompt + prefix.
    want_a, lp_a = model_a.greedy(PROMPT, k)
    want_b, lp_b = model_b.greedy(PROMPT + tokens[:k], LONG - k)
    assert tokens[:k] == want_a
    assert tokens[k:] == want_b
    assert sample.logprobs == pytest.approx(lp_a + lp_b, abs=1e-4)


async def test_resume_mode_continues_from_the_prefix(engine_on_a, model_a, model_b, streaming):
    sample, v = await _update_mid_stream(engine_on_a, model_b, "resume", streaming)
    tokens, versions = sample.completion_token_ids, sample.versions
    assert len(tokens) == LONG and sample.interruptions == 1
    k = versions.index(v + 1)
    assert 0 < k < LONG
    assert versions == [v] * k + [v + 1] * (LONG - k)
    assert tokens[:k] == model_a.greedy(PROMPT, k)[0]
    want_b, lp_b = model_b.greedy(PROMPT + tokens[:k], LONG - k)
    assert tokens[k:] == want_b
    assert sample.logprobs[k:] == pytest.approx(lp_b, abs=1e-4)


async def test_restart_mode_starts_over_under_new_weights(engine_on_a, model_b, streaming):
    sample, v = await _update_mid_stream(engine_on_a, model_b, "restart", streaming)
    assert sample.interruptions == 1
    assert sample.versions == [v + 1] * LONG
    assert sample.completion_token_ids == model_b.greedy(PROMPT, LONG)[0]


async def test_progress_of_a_running_request_is_a_prefix_of_its_final_output(engine_on_a, model_b):
    """What a checkpoint saves of a sample in flight (read while the request streams, across a
    weight update) is exactly the start of what the request finally returns."""
    engine = engine_on_a
    progress = Progress()
    spec = SamplingSpec(temperature=1.0, max_tokens=96, ignore_eos=True, seed=7)
    task = asyncio.create_task(rollout(engine, _prompt(), spec, group_id="snap", index=0, progress=progress))
    snapshots: list = []
    updated = False
    while not task.done():
        snap = progress.snapshot(engine)
        if snap.done is None and len(snap.tokens) > (len(snapshots[-1].tokens) if snapshots else 0):
            snapshots.append(snap)
        if len(snapshots) == 3 and not updated:
            await engine.update_weights(model_b.state_dict())  # later snapshots span two versions
            updated = True
        await asyncio.sleep(0.005)
    sample = await task
    assert progress.snapshot(engine).done == sample
    assert len(snapshots) >= 4 and 0 < len(snapshots[0].tokens) < len(snapshots[-1].tokens) < 96
    assert len(set(snapshots[-1].versions)) == 2
    for snap in snapshots:
        k = len(snap.tokens)
        assert snap.tokens == sample.completion_token_ids[:k]
        assert snap.versions == sample.versions[:k]
        assert snap.logprobs == sample.logprobs[:k]
    assert engine.partial("snap/0") is None  # finished: nothing running under that id


async def test_seeded_requests_whose_prompts_overfill_a_steps_token_budget(engine):
    """Every request of a run carries a seed. Prompts that together exceed one engine step's
    token budget have their prefill split across steps, where vLLM rewinds a request's seeded
    generator for the token it discards; a CPU generator has no offset to rewind, and the engine
    core died (`CPU Generator does not use offset`). Each request draws as its seed says."""
    import msgspec

    prompts = [[1] + [3 + (11 * i + 5 * j) % 250 for j in range(220)] for i in range(16)]  # 3,536 tokens
    spec = SamplingSpec(temperature=1.0, max_tokens=4, ignore_eos=True)

    async def draw(tag: str) -> list[list[int]]:
        outs = await asyncio.gather(*(
            engine.generate(p, msgspec.structs.replace(spec, seed=100 + i), f"{tag}-{i}") for i, p in enumerate(prompts)
        ))  # fmt: skip
        return [out.token_ids for out in outs]

    first = await draw("budget")
    assert all(len(tokens) == 4 for tokens in first)
    assert await draw("budget-again") == first  # the same seeds, the same draws
