"""The engine seam: what rollout needs from an inference engine, and nothing more.

An `Engine` streams completion tokens for a prompt given as token ids (it never re-tokenises),
reports the behaviour log-prob of every sampled token, and labels every token with the engine
version whose weights computed it. Weight updates go through one critical section,
`update_weights`, which bumps the version only when the new weights are fully loaded.

`ManagedEngine` adds what the controller and weight sync call besides streaming: start and
close, a health check, the weight-update critical section (full weights or a LoRA adapter),
worker RPCs, and the engines a weight load must reach (one, or a pool's members).

The backends are `rollflow.engine.vllm.VLLMEngine` (vLLM's AsyncLLM in this process),
`rollflow.engine.remote.RemoteEngine` (a vLLM server over HTTP) and
`rollflow.engine.pool.EnginePool` (several of them as one); `rollflow.testing.FakeEngine`
honours the same contracts deterministically for unit tests.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any, Literal, Protocol, Self

import msgspec

from rollflow.errors import EngineDeadError, WeightSyncError, WeightSyncTimeout
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
"""Named tensors in the model's checkpoint naming: a mapping (what `model.state_dict()` returns)
or (name, tensor) pairs. Every engine takes it through `named` once, at its boundary."""


def named(weights: Weights) -> list[tuple[str, Any]]:
    """`weights` as (name, tensor) pairs, whichever of the two forms it came in."""
    return list(weights.items()) if isinstance(weights, Mapping) else list(weights)


class WorkerCall(msgspec.Struct, frozen=True):
    """A weight load that is one call of a worker's load method (`rollflow.engine.worker.LOADS`)
    on every worker addressed. An engine that can runs it in the same engine-side call as the
    version label and the prefix-cache reset (`rollflow.engine.vllm`); any other engine makes
    it with `rpc` inside its critical section."""

    method: str
    args: tuple[Any, ...] = ()


Load = Callable[[], Awaitable[object]] | WorkerCall
"""What a weight update runs to move the staged weights into the workers."""


def load_callable(engine: ManagedEngine, load: Load) -> Callable[[], Awaitable[object]]:
    """`load` as a function to await: a `WorkerCall` becomes `engine.rpc(method, *args)`."""
    if isinstance(load, WorkerCall):
        return lambda: engine.rpc(load.method, *load.args)
    return load


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


class ManagedEngine(Engine, Protocol):
    """An `Engine` the controller owns: it starts, stops, is watched, and takes weight updates."""

    async def start(self) -> Self:
        """Start the engine (processes, sessions); raises `EngineError` when it cannot."""
        ...

    async def check_health(self) -> None:
        """Raise `EngineDeadError` if the engine is gone (a pool takes dead members out)."""
        ...

    async def update_weights_with(
        self,
        load: Load,
        *,
        partial: PartialMode = "keep",
        deadline_s: float | None = None,
        version: int | None = None,
    ) -> int:
        """The critical section around `load` (a transport moving staged weights into the
        workers): pause -> load -> label -> reset the prefix cache -> resume; returns the new
        version (`version`: label the weights with it instead of the next one)."""
        ...

    async def update_adapter(
        self,
        tensors: dict[str, Any],
        adapter_config: dict[str, Any],
        *,
        partial: PartialMode = "keep",
        version: int | None = None,
    ) -> int:
        """Adapter-only sync: serve this LoRA adapter as the next version (or `version`)."""
        ...

    async def rpc(self, method: str, *args: Any) -> list[Any]:
        """Call a `rollflow.engine.worker.WorkerExtension` method on every worker addressed."""
        ...

    def engines(self) -> list[ManagedEngine]:
        """Every live engine behind this one: itself, or a pool's members."""
        ...

    def targets(self) -> list[ManagedEngine]:
        """The engines a weight load addresses now: inside a pool member's critical section that
        member alone, else `engines()`."""
        ...

    def weight_transfer_api(self) -> Any:
        """vLLM's weight-transfer calls for this engine (the NCCL transport); raises
        `WeightSyncError` for an engine that has none."""
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


Stage = tuple[str, Callable[[], Awaitable[object]]]
"""One named step of a weight update (`pause`, `load`, `label`, ...)."""


async def critical_section(
    what: str,
    version: int,
    stages: Sequence[Stage],
    *,
    deadline_s: float,
    resume: Callable[[], Awaitable[object]],
    can_resume: Callable[[], bool],
    dead: Callable[[Exception], EngineDeadError | None] = lambda err: None,
    intact: Callable[[], Awaitable[bool]] | None = None,
    lose: Callable[[str], Awaitable[EngineDeadError]] | None = None,
    timings: dict[str, float] | None = None,
    load_stage: str = "load",
) -> None:
    """Run a weight update's stages under one deadline; on success resume the engine.

    `timings`, when given, receives each finished stage's seconds by name, and `resume`'s.
    `load_stage` names the stage from which the engine's weights may change (an engine that
    loads, labels and resets in one call names that call).

    The engine adapters own the stages (pause -> load -> label -> reset the prefix cache) and bump
    their version only when this returns. A failure leaves the engine in one of two states only:

    - provably on its previous weights and label (the failure came before `load`, or during it
      and `intact()` confirms the worker never began changing the model): it is resumed and a
      `WeightSyncError` (`WeightSyncTimeout` for a stalled stage) says it keeps `version`;
    - otherwise (a failure after the load began changing weights, a stalled load still running
      inside the engine, a failed label or prefix-cache reset after new weights went in) its
      weights are unknown: `lose(reason)` takes it out of service and the `EngineDeadError` it
      returns is raised, so the caller replaces the engine and no token is ever served under a
      label that does not name its weights.

    `dead` turns an error that means the engine is gone into `EngineDeadError`; `resume` runs
    with the same deadline, and an engine that cannot resume is dead.
    """
    names = [name for name, _ in stages]
    load_at = names.index(load_stage) if load_stage in names else len(names)
    at = 0
    error: WeightSyncError | None = None
    try:
        async with asyncio.timeout(deadline_s):
            for at, (name, run) in enumerate(stages):  # noqa: B007 - `at` is read after the loop
                began = time.perf_counter()
                await run()
                if timings is not None:
                    timings[name] = time.perf_counter() - began
    except TimeoutError:
        error = WeightSyncTimeout(
            f"weight update of {what} after version {version} stalled in stage '{names[at]}' for more than "
            f"{deadline_s:g} s (engine.update_deadline_s)"
        )
    except EngineDeadError:
        raise
    except Exception as err:
        gone = dead(err)
        if gone is not None:
            raise gone from err
        error = WeightSyncError(f"weight update of {what} after version {version} failed in stage '{names[at]}': {err}")
        error.__cause__ = err
    if error is not None and at >= load_at and lose is not None:
        stalled = isinstance(error, WeightSyncTimeout)
        if stalled or at > load_at or intact is None or not await _confirmed(intact, deadline_s):
            raise await lose(f"{error}; its weights may no longer be version {version}") from error
    if can_resume():
        try:
            began = time.perf_counter()
            async with asyncio.timeout(deadline_s):
                await resume()
            if timings is not None:
                timings["resume"] = time.perf_counter() - began
        except TimeoutError:
            raise EngineDeadError(f"{what} did not resume within {deadline_s:g} s after a weight update") from None
    if error is not None:
        error.args = (f"{error.args[0]}; the engine keeps version {version}",)
        raise error


async def _confirmed(intact: Callable[[], Awaitable[bool]], deadline_s: float) -> bool:
    """Whether the engine confirms, within the deadline, that its weights were not touched."""
    try:
        async with asyncio.timeout(deadline_s):
            return await intact()
    except Exception:
        return False


__all__ = [
    "Engine",
    "EngineOutput",
    "FinishReason",
    "Load",
    "ManagedEngine",
    "PartialMode",
    "Stage",
    "Weights",
    "WorkerCall",
    "critical_section",
    "load_callable",
    "named",
    "spans_to_versions",
]
