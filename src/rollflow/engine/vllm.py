"""The vLLM backend: an in-process `AsyncLLM` behind rollflow's `Engine` contract.

Every vLLM call rollflow makes lives in this file and its neighbours (`engine.updates`: the
weight-update critical section; `engine.environment`: process settings and `SamplingParams`;
`engine.adapters`: LoRA adapter folders; `engine.worker`: the worker side), so a vLLM upgrade
(CPU 0.32, GPU 0.33) changes one package. What it adds on top of AsyncLLM:

- token-in/token-out streaming with the sampled token's log-prob per token;
- exact per-token versions. The version label is attached by vLLM's engine core to each step's
  outputs and only changes while generation is paused, so a token's label is the version of
  the weights that computed it, by construction rather than by timing. The adapter turns the
  final output's version spans into one version per token;
- `update_weights`, the critical section (`engine.updates`): pause -> load -> set the version
  label -> reset the prefix cache -> resume (in `finally`). In `keep` mode running requests stay in the engine;
  unless `keep_kv_on_update`, their KV is recomputed under the new weights, so every token after
  the update is exactly what the new weights produce from the prefix. A load that is one worker
  call (`WorkerCall`: the shm and checkpoint transports, `update_weights`) runs as a single
  engine-core call that loads, labels and resets between two model steps (`rollflow_update` in
  `engine.worker`): no pause and no resume, one round trip instead of five. With
  `engine.linear_layout = "staged"` such a load is first staged on a thread of the engine
  process while it keeps generating (`rollflow_stage`), and the one call only makes it live;
- vLLM's dead-engine error becomes rollflow's `EngineDeadError`.

It does not choose what to generate or when to update; rollout and the controller do.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

from rollflow.config import EngineConfig
from rollflow.engine import (
    EngineOutput,
    Load,
    ManagedEngine,
    PartialMode,
    Weights,
    spans_to_versions,
)
from rollflow.engine.adapters import Adapters, AdapterSync
from rollflow.engine.environment import (
    check_kv_cache,
    engine_args,
    prepare_environment,
    resolve_context,
    sampled_logprobs,
    sampling_params,
    shut_down,
    shut_down_when_built,
)
from rollflow.engine.updates import FullUpdates
from rollflow.errors import EngineDeadError, EngineError, RequestRefused
from rollflow.records import SamplingSpec

log = logging.getLogger(__name__)


class VLLMEngine:
    """rollflow's `Engine` over vLLM's `AsyncLLM`, in this process's event loop."""

    def __init__(
        self,
        model_path: str | Path,
        config: EngineConfig = EngineConfig(),  # noqa: B008 - frozen Struct
        *,
        dtype: str = "float32",
    ) -> None:
        self.model_path = str(model_path)
        self.config = resolve_context(config, model_path)
        self.dtype = dtype
        self._llm: Any = None
        self._died: EngineDeadError | None = None
        self._version = 0
        self._update_lock = asyncio.Lock()
        self._aborted: set[str] = set()
        self._live: dict[str, int | None] = {}
        """Requests streaming, with the adapter version each started on (None: no adapters)."""
        self._late_start: asyncio.Task[None] | None = None
        """Shuts down the engine of a start that timed out, once its thread has built it."""
        self.adapters = Adapters()
        """Loaded LoRA adapters by version (adapter-only sync); version 0 is the base model."""
        self.salt_prefix_cache = True
        """Salt prefix-cache keys with the version (tests turn this off to show the stale-KV bug)."""
        self.reset_prefix_cache_on_update = True
        """Reset the prefix cache in every update (tests turn this off to show the stale-KV bug)."""
        self.last_update_s: dict[str, float] = {}
        """Seconds of each stage of the last successful weight update: `update` (the one
        engine-core call, waiting for the step in progress included) and its parts `load`,
        `label`, `reset prefix cache`, with `stage` before it when the load was staged while the
        engine generated; or, in stages, `pause`, `load`, ..., `resume`."""
        self.one_call_updates = False
        """Whether a `WorkerCall` load runs as one engine-core call (found out at start)."""
        self.stages_updates = False
        """Whether such a load is staged first while the engine generates (`staged` layout)."""
        self.full = FullUpdates(self)
        """Whole-model weight updates (the critical section)."""
        self.adapter_sync = AdapterSync(self)
        """Adapter-only weight sync (LoRA)."""

    @property
    def version(self) -> int:
        return self._version

    async def load_weights(self, weights: Weights) -> None:
        """Load named tensors into the (paused) engine. Prefer `update_weights`."""
        await self.full.load_weights(weights)

    async def update_weights(
        self, weights: Weights, *, partial: PartialMode = "keep", version: int | None = None
    ) -> int:
        return await self.full.update_weights(weights, partial=partial, version=version)

    async def update_weights_with(
        self, load: Load, *, partial: PartialMode = "keep", deadline_s: float | None = None, version: int | None = None
    ) -> int:
        """The weight-update critical section around `load` (`FullUpdates.update_weights_with`)."""
        return await self.full.update_weights_with(load, partial=partial, deadline_s=deadline_s, version=version)

    async def update_adapter(
        self,
        tensors: dict[str, Any],
        adapter_config: dict[str, Any],
        *,
        partial: PartialMode = "keep",
        version: int | None = None,
    ) -> int:
        """Load a LoRA adapter as the next version (`AdapterSync.update_adapter`); returns it."""
        return await self.adapter_sync.update_adapter(tensors, adapter_config, partial=partial, version=version)

    async def collect_adapters(self) -> None:
        """Unload adapters that are neither the newest nor used by an in-flight request."""
        await self.adapter_sync.collect()

    @property
    def loaded_adapters(self) -> list[int]:
        """Versions of the LoRA adapters currently loaded."""
        return sorted(self.adapters.loaded)

    @property
    def num_live(self) -> int:
        """Requests currently streaming."""
        return len(self._live)

    async def start(self) -> VLLMEngine:
        """Start the engine processes (15-50 s on CPU, see `engine.enforce_eager`); raises
        `EngineError` on failure."""
        check_kv_cache(self.model_path, self.config, self.dtype)
        prepare_environment(self.config)
        from vllm.v1.engine.async_llm import AsyncLLM

        args = engine_args(self.model_path, self.config, self.dtype)
        began = time.monotonic()
        log.info("starting vLLM engine for %s", self.model_path)
        # Building AsyncLLM blocks while it spawns and waits for the engine core; do it off the
        # loop. Its output handler binds to this loop at the first request.
        building = asyncio.ensure_future(asyncio.to_thread(AsyncLLM.from_engine_args, args))
        try:
            self._llm = await asyncio.wait_for(asyncio.shield(building), timeout=self.config.start_timeout_s)
        except TimeoutError:
            # The thread cannot be stopped: shut the engine down when it is built (`aclose` waits).
            self._late_start = asyncio.create_task(shut_down_when_built(building), name="vllm-late-start-shutdown")
            raise EngineError(
                f"vLLM engine for {self.model_path} did not start within {self.config.start_timeout_s:.0f} s "
                "(engine.start_timeout_s)"
            ) from None
        except Exception as err:
            raise EngineError(f"vLLM engine for {self.model_path} failed to start: {err}") from err
        await self._llm.update_weight_version(str(self._version))
        # The engine process ends by itself if this process is killed without closing it.
        parents = await self._llm.collective_rpc("rollflow_watch_parent")
        log.info("engine processes watch their parents %s (this process is %d)", parents, os.getpid())
        try:
            refused = await self._llm.engine_core.call_utility_async("rollflow_update_refused")
        except Exception as err:  # the worker is not in the engine core's process
            refused = f"the engine core has no rollflow_update ({err})"
        self.one_call_updates = not refused
        if refused:
            log.info("weight updates run in stages: %s", refused)
        else:
            self.stages_updates = all(await self._llm.collective_rpc("rollflow_stages_updates"))
        if self.config.enforce_eager:
            # vLLM compiles its sampler's helpers at an eager engine's first request (about 3 s on
            # a 2-core CPU; a compiled engine does it in its warm-up): here, so that neither the
            # first rollouts nor a weight update's deadline pay for it.
            try:
                await self.generate([0], SamplingSpec(max_tokens=1), "rollflow-warm-up")
            except Exception as err:
                await self.aclose()
                raise EngineError(f"vLLM engine for {self.model_path} failed its first request: {err}") from err
        log.info("vLLM engine ready in %.1f s", time.monotonic() - began)
        return self

    async def __aenter__(self) -> VLLMEngine:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    @property
    def llm(self) -> Any:
        """The underlying AsyncLLM (for benchmarks and tests that compare against it)."""
        if self._died is not None:  # dead, or taken out of service: for every later caller
            raise self._died
        if self._llm is None:
            raise EngineError("engine not started: call `await engine.start()` first")
        return self._llm

    async def _take_out_of_service(self, reason: str) -> EngineDeadError:
        """A weight update left the model's weights unknown: never serve again. Every later call
        raises `EngineDeadError`; requests in flight (paused, so their tokens so far are labelled
        right) are aborted and come back preempted, and their resubmission meets the dead engine,
        so the controller continues them on a replacement holding the trainer's weights."""
        message = f"vLLM engine for {self.model_path} taken out of service: {reason}"
        self._died = EngineDeadError(message)
        if self._llm is not None and self._live:
            with contextlib.suppress(Exception):
                await self._llm.abort(list(self._live))
        return EngineDeadError(message)

    def _dead(self, err: BaseException, partial: EngineOutput | None = None) -> EngineDeadError:
        message = f"vLLM engine core for {self.model_path} died: {err or 'process gone'}"
        self._died = EngineDeadError(message)
        return EngineDeadError(message, partial=partial)

    async def stream(
        self, request_id: str, prompt_token_ids: list[int], sampling: SamplingSpec, *, deltas: bool = True
    ) -> AsyncGenerator[EngineOutput, None]:
        from vllm.exceptions import VLLMClientError
        from vllm.inputs.engine import tokens_input
        from vllm.v1.engine.exceptions import EngineDeadError as VLLMDead

        llm = self.llm
        # Token ids in vLLM's engine-input form: nothing to render or tokenize. The prefix cache is
        # salted by version: a request never reuses KV computed under older weights.
        prompt = tokens_input(prompt_token_ids, cache_salt=f"v{self._version}" if self.salt_prefix_cache else None)
        # With adapter-only sync a request keeps the adapter it started with to the end, so all
        # its tokens carry that adapter's version: the newest, or the one asked for if still held.
        adapter_version = self._version if self.adapters.loaded else None
        if adapter_version is not None and self.adapter_sync.holds(sampling.on_version):
            adapter_version = sampling.on_version
        lora = self.adapters.use(adapter_version) if adapter_version is not None else None
        self._live[request_id] = adapter_version
        produced = 0
        started = False
        try:
            async for out in llm.generate(prompt, sampling_params(sampling, deltas), request_id, lora_request=lora):
                started = True
                completion = out.outputs[0]
                tokens = list(completion.token_ids)
                produced += len(tokens)
                logprobs = sampled_logprobs(tokens, completion.logprobs)
                if len(logprobs) != len(tokens):
                    raise EngineError(f"request {request_id}: {len(tokens)} tokens but {len(logprobs)} log-probs")
                if completion.finish_reason is None:
                    yield EngineOutput(tokens, logprobs)
                    continue
                if adapter_version is not None:
                    versions = [adapter_version] * produced
                else:
                    spans = completion.weight_versions or []
                    versions = spans_to_versions(((int(s.version), s.start, s.end) for s in spans), produced)
                reason = completion.finish_reason
                if reason == "abort" and request_id not in self._aborted:
                    reason = "preempted"  # only a weight update aborts what the caller did not
                yield EngineOutput(tokens, logprobs, reason, versions)
        except VLLMDead as err:
            # The client keeps the request's state: hand over what it had produced.
            raise self._dead(err, self.partial(request_id)) from err
        except (VLLMClientError, ValueError) as err:
            if started:
                raise
            # vLLM refused this request (too long, empty, ...): this request fails, not the engine.
            raise RequestRefused(f"request {request_id}: the engine refused it: {err}") from err
        finally:
            self._live.pop(request_id, None)
            self._aborted.discard(request_id)
            if adapter_version is not None:
                self.adapters.release(adapter_version)

    def partial(self, request_id: str) -> EngineOutput | None:
        """The tokens, log-probs and versions a running request has produced so far (None if
        it is not running). A checkpoint saves this so a resumed run continues the sample.

        Requests stream with vLLM's FINAL_ONLY output kind (no per-token round trip to the
        client), so the progress is read from the client-side output processor's request state,
        which accumulates exactly what the final output will hold. This reads vLLM internals
        (0.32); the integration test checks it against the final output.
        """
        if request_id not in self._live or self._llm is None:
            return None
        processor = self._llm.output_processor
        internal = processor.external_req_ids.get(request_id) or []
        state = processor.request_states.get(internal[0]) if internal else None
        if state is None or state.detokenizer is None or state.logprobs_processor is None:
            return None
        tokens = list(state.detokenizer.output_token_ids)
        if not tokens:
            return EngineOutput([], [], versions=[])
        logprobs = sampled_logprobs(tokens, state.logprobs_processor.logprobs)
        adapter_version = self._live[request_id]
        if adapter_version is not None:  # adapters are versioned by name: vLLM's label stays 0
            return EngineOutput(tokens, logprobs, versions=[adapter_version] * len(tokens))
        starts = state.weight_version_starts
        ends = [start for _, start in starts[1:]] + [len(tokens)]
        versions = spans_to_versions(((int(v), s, e) for (v, s), e in zip(starts, ends, strict=True)), len(tokens))
        return EngineOutput(tokens, logprobs, versions=versions)

    async def abort(self, request_id: str) -> None:
        if request_id in self._live and self._died is None:
            self._aborted.add(request_id)
            await self.llm.abort(request_id)

    async def pause(self, *, keep: bool = True) -> None:
        """Stop scheduling. `keep`: freeze in-flight requests; otherwise abort them.

        `keep` asks the engine core directly: `AsyncLLM.pause_generation` ends with a fixed 20 ms
        sleep so that outputs already produced reach their streams first, an ordering nothing
        here depends on (a token's version is the engine core's label for the step that made it).
        It was most of the pause. Aborting keeps vLLM's call, whose aborted outputs then arrive
        before the weights change."""
        if keep:
            await self.llm.engine_core.pause_scheduler_async(mode="keep", clear_cache=False)
        else:
            await self.llm.pause_generation(mode="abort", clear_cache=False)

    async def resume(self) -> None:
        await self.llm.resume_generation()

    async def rpc(self, method: str, *args: Any) -> list[Any]:
        """Call a `WorkerExtension` method on every worker; returns their results."""
        return await self.llm.collective_rpc(method, args=args)

    async def check_health(self) -> None:
        """Raise `EngineDeadError` if the engine process is gone."""
        from vllm.v1.engine.exceptions import EngineDeadError as VLLMDead

        try:
            await self.llm.check_health()
        except VLLMDead as err:
            raise self._dead(err) from err

    def engines(self) -> list[ManagedEngine]:
        return [self]

    def targets(self) -> list[ManagedEngine]:
        return [self]

    def weight_transfer_api(self) -> Any:
        """The AsyncLLM itself: it has vLLM's weight-transfer calls."""
        return self.llm

    async def generate(self, prompt_token_ids: list[int], sampling: SamplingSpec, request_id: str) -> EngineOutput:
        """Convenience: the whole completion as one output."""
        tokens: list[int] = []
        logprobs: list[float] = []
        async for out in self.stream(request_id, prompt_token_ids, sampling):
            tokens += out.token_ids
            logprobs += out.logprobs
            if out.finish_reason is not None:
                return EngineOutput(tokens, logprobs, out.finish_reason, out.versions)
        raise EngineError(f"request {request_id}: stream ended without a finish reason")

    async def aclose(self) -> None:
        if self._late_start is not None:  # a start that timed out: its engine goes once built
            late, self._late_start = self._late_start, None
            await late
        if self._llm is None:
            return
        llm, self._llm = self._llm, None
        if self._live and not llm.errored:
            await llm.abort(list(self._live))
        # Stop the output handler before the engine core goes away; otherwise it reports the
        # orderly shutdown as a dead engine.
        handler = getattr(llm, "output_handler", None)
        if handler is not None and not handler.done():
            handler.cancel()
            await asyncio.gather(handler, return_exceptions=True)
        await shut_down(llm)
        self.adapters.close()
