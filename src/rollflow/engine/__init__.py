"""The engine seam: what rollout needs from an inference engine, and nothing more.

An `Engine` streams completion tokens for a prompt given as token ids (it never re-tokenises),
reports the behaviour log-prob of every sampled token, and labels every token with the engine
version whose weights computed it. Weight updates go through one critical section,
`update_weights`, which bumps the version only when the new weights are fully loaded.

The real backend is `rollflow.engine.vllm.VLLMEngine` (vLLM's AsyncLLM); `FakeEngine` in
`rollflow.engine.fake` honours the same contract deterministically for unit tests.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Iterable, Mapping
from typing import Literal, Protocol

import msgspec

from rollflow.records import SamplingSpec

FinishReason = Literal["stop", "length", "abort", "preempted"]
"""`abort`: the caller aborted the request. `preempted`: a weight update aborted it
(`resume`/`restart` modes); the rollout resubmits it."""

PartialMode = Literal["keep", "resume", "restart"]


class EngineOutput(msgspec.Struct, gc=False):
    """One streamed delta of one request."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason | None = None
    versions: list[int] | None = None
    """On the final output only: the version of every token this request produced."""


Weights = Mapping[str, object] | Iterable[tuple[str, object]]
"""Named tensors in the model's checkpoint naming (what `model.state_dict()` yields)."""


class Engine(Protocol):
    """What rollout and weight sync need from an inference engine."""

    @property
    def version(self) -> int:
        """Number of weight updates loaded; 0 = initial weights."""
        ...

    def stream(
        self, request_id: str, prompt_token_ids: list[int], sampling: SamplingSpec, *, deltas: bool = True
    ) -> AsyncGenerator[EngineOutput, None]:
        """Generate a completion as deltas; the last one has `finish_reason` and `versions`.

        `deltas=False` asks for the whole completion in one final output (less client work when
        nobody watches tokens arrive). Cancelling the iteration aborts the request and re-raises.
        """
        ...

    def partial(self, request_id: str) -> EngineOutput | None:
        """The tokens, log-probs and versions a running request has produced so far, or None
        if it is not running (what a checkpoint saves of a sample in flight)."""
        ...

    async def abort(self, request_id: str) -> None:
        """End a request; its stream finishes with `finish_reason="abort"`."""
        ...

    async def update_weights(
        self, weights: Weights, *, partial: PartialMode = "keep", version: int | None = None
    ) -> int:
        """Pause, load `weights`, bump the version (or label them `version`), resume; return the
        new version.

        `keep`: in-flight requests continue under the new weights. `resume`/`restart`:
        in-flight requests end with `finish_reason="preempted"` for the rollout to resubmit.
        """
        ...

    async def aclose(self) -> None:
        """Abort everything and release the engine's processes."""
        ...


def spans_to_versions(spans: Iterable[tuple[int, int, int]], num_tokens: int) -> list[int]:
    """Expand (version, start, end) spans into one version per token, checking coverage."""
    versions: list[int] = []
    for version, start, end in spans:
        if start != len(versions) or end < start:
            raise ValueError(f"version spans are not contiguous at token {len(versions)}: {start}..{end}")
        versions.extend([version] * (end - start))
    if len(versions) != num_tokens:
        raise ValueError(f"version spans cover {len(versions)} tokens, the request produced {num_tokens}")
    return versions


__all__ = ["Engine", "EngineOutput", "FinishReason", "PartialMode", "Weights", "spans_to_versions"]
