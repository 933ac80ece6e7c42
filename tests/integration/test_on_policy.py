"""Trainer log-probs against the real vLLM engine's behaviour log-probs, on the same weights."""

from __future__ import annotations

import asyncio
import math

import msgspec
import pytest

from rollflow.batch import train_sample
from rollflow.models import tiny_model_path
from rollflow.records import Prompt, SamplingSpec
from rollflow.rollout import rollout
from rollflow.trainer import Trainer

pytestmark = pytest.mark.integration

PROMPTS = [[1, 735, 202, 276, 261 + i, 264, 277, 281, 34, 2, 202, 1, 871, 202] for i in range(6)]


async def _samples(engine, spec: SamplingSpec):
    return await asyncio.gather(
        *(rollout(engine, Prompt(id=f"op{i}", token_ids=p), spec, group_id=f"op-{spec.top_k}-{i}", index=0)
          for i, p in enumerate(PROMPTS))
    )


def _ratios(trainer: Trainer, samples, **override) -> list[float]:
    packed = [msgspec.structs.replace(train_sample(s, 0.0), **override) for s in samples]
    scored = trainer.score(packed)
    pairs = (zip(lps, s.logprobs, strict=True) for s, lps in zip(packed, scored, strict=True))
    return [math.exp(t - b) for pair in pairs for t, b in pair]


@pytest.mark.parametrize(
    "spec",
    [
        SamplingSpec(temperature=0.8, max_tokens=24),
        SamplingSpec(temperature=0.7, top_k=10, max_tokens=24),
        SamplingSpec(temperature=1.2, top_p=0.8, max_tokens=24),
    ],
    ids=["temperature", "top_k", "top_p"],
)
async def test_sampling_aware_logprobs_give_unit_ratios(engine_on_a, spec):
    samples = await _samples(engine_on_a, spec)
    assert all(set(s.versions) == {engine_on_a.version} for s in samples)
    trainer = Trainer(tiny_model_path(0))
    ratios = _ratios(trainer, samples)
    assert len(ratios) > 50
    assert max(abs(r - 1.0) for r in ratios) < 1e-3
    if spec.top_k or spec.top_p < 1.0:
        # Scoring over the full vocabulary instead of the sampled support is biased: every
        # ratio is the kept mass, below 1.
        biased = _ratios(trainer, samples, top_k=0, top_p=1.0)
        assert max(biased) < 1.0
        assert sum(biased) / len(biased) < 0.98
    else:
        # Ignoring the temperature is a different distribution altogether.
        wrong = _ratios(trainer, samples, temperature=1.0)
        assert max(abs(r - 1.0) for r in wrong) > 0.05
