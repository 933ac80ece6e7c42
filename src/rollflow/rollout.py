"""One sample, start to finish: stream tokens, keep their provenance, survive weight updates.

`rollout` is one coroutine per sample. It streams a completion from the engine and records,
for every token, the behaviour log-prob and the version of the weights that computed it. When
a weight update preempts the request (`resume` / `restart` partial modes), it resubmits:

- `keep`: the engine never preempts; the request continues under the new weights and its
  later tokens carry the new version (one sample can span versions).
- `resume`: the tokens so far are kept (with their log-probs and versions) and prompt + prefix
  is resubmitted for the remaining budget, re-prefilled under the new weights.
- `restart`: the tokens so far are discarded and the sample starts again from the prompt.

A rollout can start from a saved prefix (`PartialSample`, from a checkpoint) and exposes its
progress while it runs (`Progress.snapshot`), tokens still streaming in the engine included,
so a checkpoint can save it and a resumed run continue it. Cancellation aborts the engine
request and re-raises. Scoring and grouping happen elsewhere.
"""

from __future__ import annotations

import contextlib
import hashlib

import msgspec

from rollflow.engine import Engine, EngineOutput, PartialMode
from rollflow.episodes import Recording, Sequence, sample_of
from rollflow.errors import EngineDeadError, EngineError
from rollflow.records import Prompt, Sample, SamplingSpec

MAX_INTERRUPTIONS = 64
"""A sample preempted more often than this is an error: updates are outpacing generation."""


def unusable(prompt: Prompt, max_model_len: int) -> str | None:
    """Why the engine would refuse `prompt` (no tokens, or no room to generate in its context of
    `max_model_len` tokens), or None: training and evaluation drop such a prompt before it is sent."""
    n = len(prompt.token_ids)
    if n == 0:
        return "prompt unusable: it has no tokens"
    if n >= max_model_len:
        return f"prompt too long: {n} tokens leave no room to generate in engine.max_model_len = {max_model_len}"
    return None


class PartialSample(msgspec.Struct, kw_only=True):
    """A sample's progress: tokens so far with their log-probs and versions, or the finished
    sample. What a checkpoint saves of a rollout in flight, and what a resumed one starts from."""

    tokens: list[int] = []
    logprobs: list[float] = []
    versions: list[int] = []
    interruptions: int = 0
    done: Sample | None = None
    """The finished sample (its group is still generating)."""


class Progress:
    """A running rollout's progress, readable between awaits."""

    def __init__(self, start: PartialSample | None = None) -> None:
        self.saved = start or PartialSample()
        """Tokens of earlier requests of this sample (before a preemption or a resume)."""
        self.request_id: str | None = None
        """The engine request streaming the rest, if one is running."""

    def snapshot(self, engine: Engine) -> PartialSample:
        """A copy of the progress, with the tokens the running request has produced so far."""
        saved = self.saved
        if saved.done is not None:
            return PartialSample(done=saved.done)
        live = engine.partial(self.request_id) if self.request_id is not None else None
        extra = live or EngineOutput([], [], versions=[])
        return PartialSample(
            tokens=saved.tokens + extra.token_ids,
            logprobs=saved.logprobs + extra.logprobs,
            versions=saved.versions + (extra.versions or []),
            interruptions=saved.interruptions,
        )


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


def request_seed(run_seed: int, prompt_id: str, group_id: str, index: int) -> int:
    """The sampling seed of sample `index` of group `group_id` (prompt `prompt_id`) in a run seeded
    `run_seed`: a hash of the four, so every sample of a group draws its own random numbers
    whichever engine decodes it, an engine restarted with the same seed never repeats another
    sample's draws, and a resumed run draws what it would have drawn."""
    digest = hashlib.blake2b(f"{run_seed}\x00{prompt_id}\x00{group_id}\x00{index}".encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "big") & SEED_MASK


SEED_MASK = (1 << 31) - 1
"""Seeds stay below 2**31: every engine takes them (vLLM's server validates a 32-bit int)."""


async def rollout(
    engine: Engine,
    prompt: Prompt,
    sampling: SamplingSpec,
    *,
    group_id: str,
    index: int,
    partial: PartialMode = "keep",
    progress: Progress | None = None,
) -> Sample:
    """Generate sample `index` of `group_id` for `prompt`, continuing from `progress` if given
    (a prefix saved by a checkpoint; discarded in `restart` mode)."""
    progress = progress or Progress()
    start = progress.saved
    if start.done is not None:
        return start.done
    keep_prefix = partial != "restart"
    # The progress object owns these lists: rollout extends them in place as tokens arrive.
    tokens = start.tokens if keep_prefix else []
    logprobs = start.logprobs if keep_prefix else []
    versions = start.versions if keep_prefix else []
    progress.saved = PartialSample(
        tokens=tokens, logprobs=logprobs, versions=versions, interruptions=start.interruptions
    )
    interruptions = start.interruptions
    resumed = bool(start.tokens or start.interruptions)
    while True:
        if len(tokens) >= sampling.max_tokens:  # a saved prefix that had used the whole budget
            finish_reason = "length"
            break
        attempt = interruptions + resumed
        request_id = f"{group_id}/{index}" + (f"#{attempt}" if attempt else "")
        budget = msgspec.structs.replace(sampling, max_tokens=sampling.max_tokens - len(tokens))
        progress.request_id = request_id
        try:
            out = await _stream_once(engine, request_id, prompt.token_ids + tokens, budget)
        except EngineDeadError as err:
            # Keep what the request had produced: the caller continues from it on a new engine.
            lost = err.partial if isinstance(err.partial, EngineOutput) else None
            if lost is not None and keep_prefix:
                tokens += lost.token_ids
                logprobs += lost.logprobs
                versions += lost.versions or []
            raise
        finally:
            progress.request_id = None
        if out.finish_reason == "preempted":
            interruptions += 1
            if interruptions > MAX_INTERRUPTIONS:
                raise EngineError(
                    f"sample {request_id} was preempted {interruptions} times; updates outpace generation"
                )
            if partial == "restart":
                del tokens[:], logprobs[:], versions[:]
            else:
                tokens += out.token_ids
                logprobs += out.logprobs
                versions += out.versions or []
            progress.saved.interruptions = interruptions
            continue
        tokens += out.token_ids
        logprobs += out.logprobs
        versions += out.versions or []
        finish_reason = out.finish_reason or "stop"
        break
    mask = [1] * len(tokens)
    completion = Sequence(opening=prompt.token_ids, tokens=tokens, logprobs=logprobs, versions=versions, mask=mask)
    recording = Recording(
        last=completion, finish_reason=finish_reason, interruptions=interruptions, done_version=engine.version
    )
    sample = sample_of(prompt, recording, group_id=group_id, index=index, sampling=sampling)
    progress.saved = PartialSample(done=sample)
    return sample
