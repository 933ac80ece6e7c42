"""The fake engine: deterministic, in-process, for unit tests of rollout and the controller.

`FakeEngine` honours the `Engine` contract (streaming deltas, abort, pause, preemption, exact
per-token versions) without a model: token t of a request is a hash of (prompt + prefix,
version), and its log-prob is derived from the same hash, so a test can recompute exactly what
"the weights of version v" produce from any prefix. The test controls timing through
`token_delay` and completion lengths through `length_fn`. It is not a performance model
(see the simulator for that) and never used outside tests and benchmarks.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable
from typing import Any

from rollflow.engine import EngineOutput, Load, ManagedEngine, PartialMode, Weights, load_callable
from rollflow.errors import WeightSyncError
from rollflow.records import SamplingSpec

EOS_TOKEN = 0
"""The fake's end-of-sequence token; `length_fn` decides when it is emitted."""


_MASK = (1 << 64) - 1


def mix(state: int, value: int) -> int:
    """One splitmix64-style step: a cheap, well-spread hash of (state, value)."""
    z = (state + 0x9E3779B97F4A7C15 + value) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def context_state(tokens: list[int]) -> int:
    """The rolling hash of a token sequence (prompt + prefix)."""
    state = 0
    for token in tokens:
        state = mix(state, token)
    return state


def fake_token(state: int, version: int, vocab: int) -> tuple[int, float]:
    """The token (never EOS) and log-prob that the fake model of `version` gives after the
    context whose rolling hash is `state`."""
    value = mix(state, 1_000_003 * (version + 1))
    return 1 + value % (vocab - 1), -((value >> 20) % 1000) / 100.0


async def _nothing() -> None:
    return None


class FakeEngine:
    """A model-free `Engine` whose every output a test can predict."""

    def __init__(
        self,
        *,
        vocab: int = 1000,
        token_delay: float = 0.0,
        length_fn: Callable[[list[int]], int] | None = None,
        tokens_per_step: int = 1,
    ) -> None:
        self.vocab = vocab
        self.token_delay = token_delay
        self.tokens_per_step = tokens_per_step
        """Tokens a request produces per engine step (one await each step)."""
        self.length_fn = length_fn
        """prompt token ids -> completion length before EOS (None: run to max_tokens)."""
        self._version = 0
        self._running = asyncio.Event()
        self._running.set()
        self._aborted: set[str] = set()
        self._preempted: set[str] = set()
        self._live: set[str] = set()
        self._progress: dict[str, tuple[list[int], list[float], list[int]]] = {}
        self._lock = asyncio.Lock()
        self.tokens_generated = 0
        self.updates = 0

    @property
    def version(self) -> int:
        return self._version

    @property
    def num_live(self) -> int:
        return len(self._live)

    async def stream(
        self, request_id: str, prompt_token_ids: list[int], sampling: SamplingSpec, *, deltas: bool = True
    ) -> AsyncGenerator[EngineOutput, None]:
        self._live.add(request_id)
        state = context_state(prompt_token_ids)
        versions: list[int] = []
        produced: tuple[list[int], list[float], list[int]] = ([], [], versions)
        self._progress[request_id] = produced
        stop_at = self._stop_at(request_id, prompt_token_ids)
        try:
            while True:
                await self._step_wait(request_id, len(prompt_token_ids) + len(versions))
                await self._running.wait()
                reason = None
                if request_id in self._aborted:
                    reason = "abort"
                elif request_id in self._preempted:
                    reason = "preempted"
                if reason is not None:
                    yield EngineOutput([], [], reason, versions)  # type: ignore[arg-type]
                    return
                # One engine step: tokens are computed and labelled with no await in between,
                # so each token's version is the one in force when it was computed.
                tokens: list[int] = []
                logprobs: list[float] = []
                finish = None
                for _ in range(self.tokens_per_step):
                    if stop_at is not None and len(versions) >= stop_at:
                        token, logprob = EOS_TOKEN, -0.1
                    else:
                        token, logprob = fake_token(state, self._version, self.vocab)
                    state = mix(state, token)
                    versions.append(self._version)
                    tokens.append(token)
                    logprobs.append(logprob)
                    produced[0].append(token)
                    produced[1].append(logprob)
                    self.tokens_generated += 1
                    if token == EOS_TOKEN and not sampling.ignore_eos:
                        finish = "stop"
                        break
                    if len(versions) >= sampling.max_tokens:
                        finish = "length"
                        break
                if finish is not None:
                    self._leave(request_id, len(versions))  # its slot is free before the caller closes us
                    yield EngineOutput(tokens, logprobs, finish, versions)  # type: ignore[arg-type]
                    return
                yield EngineOutput(tokens, logprobs)
        finally:
            self._leave(request_id, len(versions))
            self._live.discard(request_id)
            self._progress.pop(request_id, None)
            self._aborted.discard(request_id)
            self._preempted.discard(request_id)

    def _stop_at(self, request_id: str, prompt_token_ids: list[int]) -> int | None:
        """Completion length before EOS (None: run to max_tokens)."""
        return self.length_fn(prompt_token_ids) if self.length_fn else None

    async def _step_wait(self, request_id: str, context_tokens: int) -> None:
        """Wait for the engine step that computes the request's next token(s)."""
        await asyncio.sleep(self.token_delay)

    def _leave(self, request_id: str, tokens: int) -> None:
        """The request ended (finished, aborted or preempted) after `tokens` tokens; may be
        called twice for one request."""

    def partial(self, request_id: str) -> EngineOutput | None:
        """What a running request has produced so far (None if it is not running)."""
        progress = self._progress.get(request_id)
        if progress is None:
            return None
        tokens, logprobs, versions = progress
        return EngineOutput(list(tokens), list(logprobs), versions=list(versions))

    async def abort(self, request_id: str) -> None:
        if request_id in self._live:
            self._aborted.add(request_id)

    async def pause(self, *, keep: bool = True) -> None:
        self._running.clear()
        if not keep:
            self._preempted.update(self._live)

    async def resume(self) -> None:
        self._running.set()

    async def start(self) -> FakeEngine:
        return self

    async def update_weights(
        self, weights: Weights, *, partial: PartialMode = "keep", version: int | None = None
    ) -> int:
        return await self.update_weights_with(_nothing, partial=partial, version=version)

    async def update_weights_with(
        self,
        load: Load,
        *,
        partial: PartialMode = "keep",
        deadline_s: float | None = None,
        version: int | None = None,
    ) -> int:
        """The same critical section as the real engine: pause, load, bump (or label), resume."""
        async with self._lock:
            await self.pause(keep=partial == "keep")
            try:
                await load_callable(self, load)()
                self._version = self._version + 1 if version is None else version
                self.updates += 1
            finally:
                await self.resume()
            return self._version

    async def update_adapter(
        self,
        tensors: dict[str, Any],
        adapter_config: dict[str, Any],
        *,
        partial: PartialMode = "keep",
        version: int | None = None,
    ) -> int:
        """An adapter is weights like any other here: the same critical section."""
        return await self.update_weights_with(_nothing, partial=partial, version=version)

    async def check_health(self) -> None:
        """A fake engine lives until a test kills it (see the engine-failure tests)."""

    async def rpc(self, method: str, *args: Any) -> list[Any]:
        """There are no workers: a transport that needs one cannot be used with the fake, and no
        load to check against a fingerprint (`rollflow_expect` answers for none)."""
        if method == "rollflow_expect":
            return []
        raise WeightSyncError(f"the fake engine has no workers to call {method!r} on; use NullTransport")

    def engines(self) -> list[ManagedEngine]:
        return [self]

    def targets(self) -> list[ManagedEngine]:
        return [self]

    def weight_transfer_api(self) -> Any:
        raise WeightSyncError("the fake engine has no weight-transfer API")

    async def aclose(self) -> None:
        for request_id in list(self._live):
            await self.abort(request_id)
