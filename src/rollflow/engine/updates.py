"""The weight-update critical section of the vLLM backend, mixed into `VLLMEngine`.

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
from typing import Any, cast

from rollflow.config import EngineConfig
from rollflow.engine import (
    Load,
    ManagedEngine,
    PartialMode,
    Stage,
    Weights,
    WorkerCall,
    critical_section,
    load_callable,
    named,
)
from rollflow.errors import EngineDeadError, WeightSyncError

log = logging.getLogger(__name__)


class FullUpdates:
    """Whole-model weight updates, mixed into `VLLMEngine` (which provides what is declared here)."""

    config: EngineConfig
    model_path: str
    _version: int
    _update_lock: asyncio.Lock
    _llm: Any
    llm: Any
    one_call_updates: bool
    stages_updates: bool
    reset_prefix_cache_on_update: bool
    last_update_s: dict[str, float]

    @property
    def managed(self) -> ManagedEngine:
        """This engine as the contract sees it (the class that mixes this in honours it)."""
        return cast(ManagedEngine, self)

    def _dead(self, err: BaseException, partial: Any = None) -> EngineDeadError:
        raise NotImplementedError

    async def _take_out_of_service(self, reason: str) -> EngineDeadError:
        raise NotImplementedError

    async def pause(self, *, keep: bool = True) -> None:
        raise NotImplementedError

    async def resume(self) -> None:
        raise NotImplementedError

    async def load_weights(self, weights: Weights) -> None:
        """Load named tensors into the (paused) engine. Prefer `update_weights`."""
        await load_callable(self.managed, await _serialised(weights))()

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

        llm = self.llm
        keep = partial == "keep"
        # Mandatory prefix-cache reset: else prompts longer than a block reuse KV from old weights.
        # In keep mode, running requests' KV is also recomputed under the new ones.
        recompute = keep and not self.config.keep_kv_on_update
        deadline = deadline_s if deadline_s is not None else self.config.update_deadline_s

        def guarded(run: Callable[[], Awaitable[object]]) -> Callable[[], Awaitable[object]]:
            return lambda: self._unless_dead(run())

        async with self._update_lock:
            new_version = self._version + 1 if version is None else version
            timings: dict[str, float] = {}
            parts: dict[str, float] = {}
            call = load if isinstance(load, WorkerCall) and self.one_call_updates else None
            one_call = call is not None
            if call is not None and self.stages_updates:
                began = time.perf_counter()
                if await self._stage(call, deadline):
                    call = WorkerCall("rollflow_commit_staged")
                    parts["stage"] = time.perf_counter() - began
            if call is not None:

                async def update() -> None:
                    args = (call.method, list(call.args), str(new_version), not keep)
                    answer = llm.engine_core.call_utility_async(
                        "rollflow_update", *args, self.reset_prefix_cache_on_update, recompute
                    )
                    parts.update(await self._unless_dead(answer))

                stages: list[Stage] = [("update", update)]
            else:
                stages = [
                    ("pause", guarded(lambda: self.pause(keep=keep))),
                    ("load", guarded(load_callable(self.managed, load))),
                    ("label", guarded(lambda: llm.update_weight_version(str(new_version)))),
                ]
                if self.reset_prefix_cache_on_update:

                    async def reset() -> None:
                        if not await self._unless_dead(llm.reset_prefix_cache(reset_running_requests=recompute)):
                            raise WeightSyncError("vLLM could not reset the prefix cache (it returned False)")

                    stages.append(("reset prefix cache", reset))

            async def intact() -> bool:
                return all(await self._unless_dead(llm.collective_rpc("rollflow_weights_intact")))

            await critical_section(
                f"vLLM engine for {self.model_path}",
                self._version,
                stages,
                deadline_s=deadline,
                resume=_never_paused if one_call else self.resume,
                can_resume=lambda: self._llm is not None and not llm.errored,
                dead=lambda err: self._dead(err) if isinstance(err, VLLMDead) else None,
                intact=intact,
                lose=self._take_out_of_service,
                timings=timings,
                load_stage="update" if one_call else "load",
            )
            if one_call:
                timings.pop("resume", None)
            self._version = new_version
            self.last_update_s = timings | parts
        return self._version

    async def _stage(self, call: WorkerCall, deadline_s: float) -> bool:
        """Stage the load `call` in the engine process while it keeps generating; False: it was
        not staged (the first load of its names and shapes, a load from files, a failure, the
        deadline), so the critical section makes it whole, which stops what is left of the stage.
        A stage changes nothing the model's forward reads, so failing here costs only time."""
        from vllm.v1.engine.exceptions import EngineDeadError as VLLMDead

        answer = self.llm.engine_core.call_utility_async("rollflow_stage", call.method, list(call.args))
        try:
            return bool(await asyncio.wait_for(self._unless_dead(answer), deadline_s))
        except VLLMDead as err:
            raise self._dead(err) from err
        except Exception as err:
            log.warning("staging the weight update failed, loading it whole instead: %r", err)
            return False

    async def _unless_dead(self, call: Awaitable[Any], poll_s: float = 0.5) -> Any:
        """Await `call`, but raise vLLM's dead-engine error as soon as the engine is known dead
        (a call to a dead engine process can wait forever for its answer)."""
        from vllm.v1.engine.exceptions import EngineDeadError as VLLMDead

        task = asyncio.ensure_future(call)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=poll_s)
                if done:
                    return task.result()
                if self.llm.errored:
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
