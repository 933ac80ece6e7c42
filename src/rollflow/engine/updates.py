"""The weight-update critical section of the vLLM backend, held by `VLLMEngine` (`engine.full`).

`update_weights_with` runs a load between two model steps: as one engine-core call that loads,
labels the new version and resets the prefix cache (`rollflow_update` in `engine.worker`; with
`engine.linear_layout = "staged"`, staged first on a thread of the engine process while it keeps
generating), or in stages: pause -> load -> label -> reset the prefix cache -> resume. A failure
either provably leaves the previous weights and label (`WeightSyncError`) or takes the engine out
of service (`EngineDeadError`): `rollflow.engine.critical_section` decides which. This module
does not start, stream or stop an engine (`engine.vllm` does).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from rollflow.engine import (
    Load,
    PartialMode,
    Stage,
    Weights,
    WorkerCall,
    critical_section,
    load_callable,
    named,
)
from rollflow.errors import WeightSyncError

if TYPE_CHECKING:
    from rollflow.engine.vllm import VLLMEngine

log = logging.getLogger(__name__)


class FullUpdates:
    """Whole-model weight updates of one `VLLMEngine`, which holds it (`engine.full`) and whose
    version, update lock and flags it reads and advances."""

    def __init__(self, engine: VLLMEngine) -> None:
        self.engine = engine

    async def load_weights(self, weights: Weights) -> None:
        """Load named tensors into the (paused) engine. Prefer `update_weights`."""
        await load_callable(self.engine, await _serialised(weights))()

    async def update_weights(
        self, weights: Weights, *, partial: PartialMode = "keep", version: int | None = None
    ) -> int:
        # Serialised before the critical section: the engine keeps generating meanwhile.
        return await self.update_weights_with(await _serialised(weights), partial=partial, version=version)

    async def update_weights_with(
        self,
        load: Load,
        *,
        partial: PartialMode = "keep",
        deadline_s: float | None = None,
        version: int | None = None,
    ) -> int:
        """The weight-update critical section around `load`; returns the new version.

        lock -> pause (keep or abort in-flight requests) -> load -> label the new version ->
        reset the prefix cache -> resume -> bump the version (only on success), under one
        deadline. A `WorkerCall` load on an engine that allows it (`one_call_updates`) runs all
        of it as one engine-core call instead, with no pause: the engine core runs no model step
        while it takes a call. A failure either provably leaves the previous weights
        (`WeightSyncError`, the engine serving its version) or takes the engine out of service
        (`EngineDeadError`); see `rollflow.engine.critical_section`. `version` labels the new
        weights with a given version instead of the next one (a resumed run restores its
        checkpoint's).
        """
        from vllm.v1.engine.exceptions import EngineDeadError as VLLMDead

        engine, llm = self.engine, self.engine.llm
        deadline = deadline_s if deadline_s is not None else engine.config.update_deadline_s
        async with engine._update_lock:
            new_version = engine._version + 1 if version is None else version
            timings: dict[str, float] = {}
            parts: dict[str, float] = {}
            call = load if isinstance(load, WorkerCall) and engine.one_call_updates else None
            one_call = call is not None
            if call is not None:
                stages = await self._one_call(call, new_version, partial, deadline, parts)
            else:
                stages = self._in_stages(load, new_version, partial)

            async def intact() -> bool:
                return all(await unless_dead(llm, llm.collective_rpc("rollflow_weights_intact")))

            await critical_section(
                f"vLLM engine for {engine.model_path}",
                engine._version,
                stages,
                deadline_s=deadline,
                resume=_never_paused if one_call else engine.resume,
                can_resume=lambda: engine._llm is not None and not llm.errored,
                dead=lambda err: engine._dead(err) if isinstance(err, VLLMDead) else None,
                intact=intact,
                lose=engine._take_out_of_service,
                timings=timings,
                load_stage="update" if one_call else "load",
            )
            if one_call:
                timings.pop("resume", None)
            engine._version = new_version
            engine.last_update_s = timings | parts
        return engine._version

    def _recompute(self, partial: PartialMode) -> bool:
        """Whether running requests' KV is computed again under the new weights. The prefix-cache
        reset itself is mandatory: else prompts longer than a block reuse KV from old weights."""
        return partial == "keep" and not self.engine.config.keep_kv_on_update

    async def _one_call(
        self, call: WorkerCall, new_version: int, partial: PartialMode, deadline_s: float, parts: dict[str, float]
    ) -> list[Stage]:
        """The update as one engine-core call (`rollflow_update`), staged first when the engine
        stages updates; `parts` gets the seconds of each part of it."""
        engine = self.engine
        if engine.stages_updates:
            began = time.perf_counter()
            if await self._stage(call, deadline_s):
                call = WorkerCall("rollflow_commit_staged")
                parts["stage"] = time.perf_counter() - began
        recompute, llm = self._recompute(partial), engine.llm

        async def update() -> None:
            args = (call.method, list(call.args), str(new_version), partial != "keep")
            answer = llm.engine_core.call_utility_async(
                "rollflow_update", *args, engine.reset_prefix_cache_on_update, recompute
            )
            parts.update(await unless_dead(llm, answer))

        return [("update", update)]

    def _in_stages(self, load: Load, new_version: int, partial: PartialMode) -> list[Stage]:
        """pause -> load -> label -> reset the prefix cache, each a call of its own."""
        engine, llm, recompute = self.engine, self.engine.llm, self._recompute(partial)

        def guarded(run: Callable[[], Awaitable[object]]) -> Callable[[], Awaitable[object]]:
            return lambda: unless_dead(llm, run())

        stages: list[Stage] = [
            ("pause", guarded(lambda: engine.pause(keep=partial == "keep"))),
            ("load", guarded(load_callable(engine, load))),
            ("label", guarded(lambda: llm.update_weight_version(str(new_version)))),
        ]
        if engine.reset_prefix_cache_on_update:

            async def reset() -> None:
                if not await unless_dead(llm, llm.reset_prefix_cache(reset_running_requests=recompute)):
                    raise WeightSyncError("vLLM could not reset the prefix cache (it returned False)")

            stages.append(("reset prefix cache", reset))
        return stages

    async def _stage(self, call: WorkerCall, deadline_s: float) -> bool:
        """Stage the load `call` in the engine process while it keeps generating; False: it was
        not staged (the first load of its names and shapes, a load from files, a failure, the
        deadline), so the critical section makes it whole, which stops what is left of the stage.
        A stage changes nothing the model's forward reads, so failing here costs only time."""
        from vllm.v1.engine.exceptions import EngineDeadError as VLLMDead

        llm = self.engine.llm
        answer = llm.engine_core.call_utility_async("rollflow_stage", call.method, list(call.args))
        try:
            return bool(await asyncio.wait_for(unless_dead(llm, answer), deadline_s))
        except VLLMDead as err:
            raise self.engine._dead(err) from err
        except Exception as err:
            log.warning("staging the weight update failed, loading it whole instead: %r", err)
            return False


async def unless_dead(llm: Any, call: Awaitable[Any], poll_s: float = 0.5) -> Any:
    """Await `call`, but raise vLLM's dead-engine error as soon as `llm` (an `AsyncLLM`) is known
    dead (a call to a dead engine process can wait forever for its answer)."""
    from vllm.v1.engine.exceptions import EngineDeadError as VLLMDead

    task = asyncio.ensure_future(call)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll_s)
            if done:
                return task.result()
            if llm.errored:
                raise VLLMDead()
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def _serialised(weights: Weights) -> WorkerCall:
    """Named tensors as one safetensors payload and the worker call that loads it (off the loop:
    serialising a whole model takes a while)."""
    from safetensors.torch import save

    tensors = {name: tensor.detach().contiguous() for name, tensor in named(weights)}
    return WorkerCall("rollflow_load_safetensors", (await asyncio.to_thread(save, tensors),))


async def _never_paused() -> None:
    """The resume of a one-call update: nothing was paused."""
