"""What rollflow asks of vLLM per request, and how it reads vLLM's record of the answer."""

from __future__ import annotations

import pytest
from vllm.logprobs import FlatLogprobs, Logprob

from rollflow.engine.environment import sampled_logprobs, sampling_params
from rollflow.errors import EngineError
from rollflow.records import SamplingSpec


def test_log_probs_are_asked_flat_and_read_the_same_in_either_form():
    params = sampling_params(SamplingSpec(temperature=1.0, max_tokens=3))
    assert params.logprobs == 0 and params.flat_logprobs
    tokens = [7, 3, 7]
    values = [-0.25, -1.5, -0.125]
    flat = FlatLogprobs()
    nested = []
    for token, value in zip(tokens, values, strict=True):
        # the sampled token first; a top-k entry after it is not the sampled one
        position = {token: Logprob(value, rank=2), 99: Logprob(-0.01, rank=1)}
        flat.append(position)
        nested.append(position)
    assert sampled_logprobs(tokens, flat) == values
    assert sampled_logprobs(tokens, nested) == values
    assert sampled_logprobs(tokens[:2], flat) == values[:2]  # a request's progress so far
    assert sampled_logprobs([], None) == []


def test_flat_log_probs_that_do_not_start_with_the_sampled_token_are_an_engine_error():
    flat = FlatLogprobs()
    flat.append({5: Logprob(-0.5)})
    with pytest.raises(EngineError, match="do not start with the sampled tokens"):
        sampled_logprobs([6], flat)
