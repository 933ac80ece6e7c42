"""One sample, start to finish: stream tokens, keep their provenance, survive weight updates.

`rollout` is one coroutine per sample. It streams a completion from the engine and records,
for every token, the behaviour log-prob and the version of the weights that computed it. When
a weight update preempts the request (`resume` / `restart` partial modes), it resubmits:

- `keep`: the engine never preempts; the request continues under the new weights and its
  later tokens carry the new version (one sample can span versions).
- `resume`: the tokens so far are kept (with their log-probs and versions) and prompt + prefix
  is resubmitted for the remaining budget, re-prefilled under the new weights.
- `restart`: the tokens so far are discarded and the sample starts again from the prompt.

Cancellation aborts the engine request and re-raises. Scoring and grouping happen elsewhere.
"""

from __future__ import annotations

import contextlib
import time

import msgspec

from rollflow.engine import Engine, EngineOutput, PartialMode
from rollflow.errors import EngineError
from rollflow.records import Prompt, Sample, SamplingSpec, Timing

MAX_INTERRUPTIONS = 64
"""A sample preempted more often than this is an error: updates are outpacing generation."""


async def _stream_once(engine: Engine, request_id: str, token_ids: list[int], sampling: SamplingSpec) -> EngineOutput:
    """Run one engine request to its end; returns all its tokens in one output."""
    tokens: list[int] = []
    logprobs: list[float] = []
    async with contextlib.aclosing(engine.stream(request_id, token_ids, sampling, deltas=False)) as stream:
        async for out in stream:
            tokens += out.token_ids
            logprobs += out.logprobs
            if out.finish_reason is not None:
                if out.versions is None or len(out.versions) != len(tokens):
                    raise EngineError(f"request {request_id}: final output lacks a version for every token")
                return EngineOutput(tokens, logprobs, out.finish_reason, out.versions)
    raise EngineError(f"request {request_id}: stream ended without a finish reason")


async def rollout(
    engine: Engine,
    prompt: Prompt,
    sampling: SamplingSpec,
    *,
    group_id: str,
    index: int,
    partial: PartialMode = "keep",
) -> Sample:
    """Generate sample `index` of `group_id` for `prompt`."""
    tokens: list[int] = []
    logprobs: list[float] = []
    versions: list[int] = []
    interruptions = 0
    submitted = time.monotonic()
    first_token: float | None = None
    while True:
        request_id = f"{group_id}/{index}" + (f"#{interruptions}" if interruptions else "")
        budget = msgspec.structs.replace(sampling, max_tokens=sampling.max_tokens - len(tokens))
        out = await _stream_once(engine, request_id, prompt.token_ids + tokens, budget)
        if first_token is None and out.token_ids:
            first_token = time.monotonic()
        if out.finish_reason == "preempted":
            interruptions += 1
            if interruptions > MAX_INTERRUPTIONS:
                raise EngineError(
                    f"sample {request_id} was preempted {interruptions} times; updates outpace generation"
                )
            if partial == "restart":
                tokens, logprobs, versions = [], [], []
            else:
                tokens += out.token_ids
                logprobs += out.logprobs
                versions += out.versions or []
            if len(tokens) < sampling.max_tokens:
                continue
            finish_reason = "length"
        else:
            tokens += out.token_ids
            logprobs += out.logprobs
            versions += out.versions or []
            finish_reason = out.finish_reason or "stop"
        return Sample(
            prompt_id=prompt.id,
            group_id=group_id,
            index=index,
            prompt_token_ids=prompt.token_ids,
            completion_token_ids=tokens,
            logprobs=logprobs,
            versions=versions,
            loss_mask=[1] * len(tokens),
            finish_reason=finish_reason,
            sampling=sampling,
            interruptions=interruptions,
            timing=Timing(submitted=submitted, first_token=first_token, finished=time.monotonic()),
        )
