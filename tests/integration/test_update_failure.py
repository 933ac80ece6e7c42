"""A weight update that fails never leaves tokens served under a label that does not name their
weights: the engine either provably keeps its previous weights and label, or is taken out of
service (and the controller replaces it). Real vLLM on CPU, one engine per case that kills one."""

from __future__ import annotations

import asyncio
import time

import pytest

from rollflow.config import EngineConfig
from rollflow.engine import WorkerCall, fingerprint
from rollflow.engine.vllm import VLLMEngine
from rollflow.errors import EngineDeadError, EngineError, WeightSyncError
from rollflow.models import tiny_model_path
from rollflow.records import SamplingSpec
from rollflow.testing import engine_processes
from rollflow.weight_sync import ShmTransport, expecting, plan_for, publish

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

PROMPT = [1, 735, 202, 276, 261, 264, 277, 281, 34, 2, 202, 1, 871, 202]
GREEDY = SamplingSpec(temperature=0.0, max_tokens=12, ignore_eos=True)


async def fresh_engine(**settings) -> VLLMEngine:
    """A new engine per test (each leaves its engine out of service); eager, so these tests run
    eager engines (the compiled engine's loads are tested in test_weight_sync.py) and its start
    includes vLLM's first-request compilation, which a 1 s deadline below does not allow for."""
    settings = {"enforce_eager": True} | settings
    config = EngineConfig(
        kv_cache_bytes=64 * 1024 * 1024, max_model_len=256, max_num_seqs=4, update_deadline_s=5, **settings
    )
    return await VLLMEngine(tiny_model_path(0), config).start()


async def assert_serves_nothing(engine: VLLMEngine) -> None:
    with pytest.raises(EngineDeadError, match="taken out of service"):
        await engine.generate(PROMPT, GREEDY, "after")
    with pytest.raises(EngineDeadError):
        await engine.check_health()  # the health watch notices it too


def with_bad_tensor_in_the_middle(state: dict) -> dict:
    names = list(state)
    middle = names[len(names) // 2]
    broken = dict(state)
    broken[middle] = state[middle].flatten()[:-1]  # a wrong shape part-way through the plan
    return broken


async def test_a_failure_before_the_model_is_touched_keeps_the_old_weights_and_label(model_a, model_b):
    engine = await fresh_engine()
    try:
        want_a = model_a.greedy(PROMPT, 12)[0]

        async def transfer_fails() -> None:
            raise ConnectionError("sender went away before the first bucket")

        with pytest.raises(WeightSyncError, match="the engine keeps version 0"):
            await engine.update_weights_with(transfer_fails)
        out = await engine.generate(PROMPT, GREEDY, "kept")
        assert out.token_ids == want_a and out.versions == [0] * 12 and engine.version == 0

        # The one engine-core call refuses a worker method that is not a load before doing anything.
        assert engine.one_call_updates
        with pytest.raises(WeightSyncError, match=r"stage 'update'.*not a weight load.*keeps version 0"):
            await engine.update_weights_with(WorkerCall("rollflow_watch_parent", (60.0,)))
        out = await engine.generate(PROMPT, GREEDY, "kept again")
        assert out.token_ids == want_a and out.versions == [0] * 12 and engine.version == 0

        # A wrong shape part-way through a load: layers may be half-loaded, so the engine is
        # taken out of service instead of serving under version 0.
        with pytest.raises(EngineDeadError, match=r"taken out of service: .*stage 'update'.*load: "):
            await engine.update_weights(with_bad_tensor_in_the_middle(model_b.state_dict()))
        assert engine.version == 0
        await assert_serves_nothing(engine)
    finally:
        await engine.aclose()


async def test_a_failure_after_new_weights_went_in_takes_the_engine_out(model_b, monkeypatch):
    """In one engine-core call: the label fails after the load (an injected fault inside the
    engine process), so the weights are B's while the label still says 0."""
    monkeypatch.setenv("ROLLFLOW_FAULT", "weights-loaded:1:raise")
    engine = await fresh_engine()
    monkeypatch.delenv("ROLLFLOW_FAULT")
    try:
        with pytest.raises(EngineDeadError, match=r"stage 'update'.*label, after the new weights were loaded"):
            await engine.update_weights(model_b.state_dict())
        assert engine.version == 0
        await assert_serves_nothing(engine)
    finally:
        await engine.aclose()


async def test_a_failure_after_new_weights_went_in_takes_the_engine_out_in_stages(model_b, monkeypatch):
    engine = await fresh_engine()
    engine.one_call_updates = False  # as an engine whose worker is not in the engine core's process
    try:
        # vLLM answers False when it cannot reset the prefix cache: the update failed after the
        # load, so the weights are B's while the label would still say 0.
        async def cannot_reset(**kwargs) -> bool:
            return False

        monkeypatch.setattr(engine.llm, "reset_prefix_cache", cannot_reset)
        with pytest.raises(EngineDeadError, match=r"stage 'reset prefix cache'.*returned False"):
            await engine.update_weights(model_b.state_dict())
        assert engine.version == 0
        await assert_serves_nothing(engine)
    finally:
        await engine.aclose()


async def test_a_load_stalled_past_the_deadline_takes_the_engine_out(model_b):
    engine = await fresh_engine()
    try:
        request = asyncio.create_task(engine.generate(PROMPT, SamplingSpec(max_tokens=200, ignore_eos=True), "live"))
        while engine.num_live == 0:
            await asyncio.sleep(0.01)

        async def stalls() -> None:
            await asyncio.sleep(30)

        with pytest.raises(EngineDeadError, match=r"stalled in stage 'load' for more than 1 s"):
            await engine.update_weights_with(stalls, deadline_s=1.0)
        # The request in flight was paused before the load: it ends (preempted, its tokens so far
        # labelled 0) instead of continuing under weights nobody knows.
        out = await asyncio.wait_for(request, 30)
        assert out.finish_reason == "preempted" and set(out.versions) <= {0}
        await assert_serves_nothing(engine)
    finally:
        await engine.aclose()


async def test_an_engine_start_that_times_out_leaves_no_engine_process():
    before = set(engine_processes())
    config = EngineConfig(kv_cache_bytes=64 * 1024 * 1024, max_model_len=256, max_num_seqs=4, start_timeout_s=1)
    engine = VLLMEngine(tiny_model_path(0), config)
    with pytest.raises(EngineError, match=r"did not start within 1 s \(engine.start_timeout_s\)"):
        await engine.start()
    began = time.monotonic()
    await asyncio.wait_for(engine.aclose(), 120)  # waits for the late-built engine and shuts it down
    # The build goes on in its thread after the deadline (an engine starts in 15-30 s here):
    # `aclose` waited for it, so it took that long, and once it returns no engine process may
    # run (5 s' grace to exit). An engine left to finish its start on its own would still be
    # starting, its process up, when `aclose` returned at once.
    assert time.monotonic() - began > 3, "aclose did not wait for the engine still starting"
    late = []
    for tick in range(20):
        running = set(engine_processes()) - before
        if running and tick >= 10:
            late.append(sorted(running))
        await asyncio.sleep(0.5)
    assert late == []


async def test_a_stage_that_fails_is_loaded_whole_and_the_engine_serves_the_new_weights(model_a, model_b, monkeypatch):
    """`staged` layout: the stage fails on its thread (an injected fault inside the engine
    process, after the plain weights may have started changing); nothing the forward reads was
    touched, so the update falls back to a whole load in the critical section, which rewrites
    every weight and packs each layer again. The next update stages again."""
    monkeypatch.setenv("ROLLFLOW_FAULT", "stage:1:raise")
    engine = await fresh_engine(linear_layout="staged")
    monkeypatch.delenv("ROLLFLOW_FAULT")
    try:
        await engine.update_weights(model_b.state_dict())  # the first load of these names: whole, watched
        assert "stage" not in engine.last_update_s
        await engine.update_weights(model_a.state_dict())  # staged, fails, loaded whole
        assert "stage" not in engine.last_update_s and engine.version == 2
        assert (await engine.generate(PROMPT, GREEDY, "a")).token_ids == model_a.greedy(PROMPT, 12)[0]
        await engine.update_weights(model_b.state_dict())
        assert "stage" in engine.last_update_s and engine.version == 3
        assert (await engine.generate(PROMPT, GREEDY, "b")).token_ids == model_b.greedy(PROMPT, 12)[0]
    finally:
        await engine.aclose()


@pytest.mark.parametrize(("layout", "way"), [("staged", "shm"), ("plain", "bytes")])
async def test_a_load_that_silently_leaves_a_tensor_out_fails_its_fingerprint(
    model_a, model_b, monkeypatch, layout, way
):
    """Inside the engine process the second repeated load leaves its first tensor out (an
    injected fault: a staged load's stage, or a plain load's replayed copies). Checked against the fingerprint
    of what was sent (with the load in one worker call through shared memory, as a training run
    sends it, or handed over first for a load of bytes, as a new engine gets the trainer's
    weights), the update fails naming the tensor, and the engine is taken out of service instead
    of serving the old tensor under the new label."""
    monkeypatch.setenv("ROLLFLOW_FAULT", "load-copy:2:skip")
    engine = await fresh_engine(linear_layout=layout)
    monkeypatch.delenv("ROLLFLOW_FAULT")
    transport = ShmTransport()
    plan = plan_for(model_b.state_dict())

    async def update(state: dict) -> None:
        if way == "shm":
            await transport.stage(plan, state.items())
            await publish(engine, transport, plan, expect=fingerprint.of(state.items()))
        else:
            await expecting(engine, fingerprint.of(state.items()), lambda: engine.update_weights(state))

    try:
        b, a = model_b.state_dict(), model_a.state_dict()
        await update(b)  # the first load of these names: watched, and checked
        await update(a)
        assert (
            engine.version == 2
            and (await engine.generate(PROMPT, GREEDY, "a")).token_ids == model_a.greedy(PROMPT, 12)[0]
        )
        first = sorted(a)[0]
        with pytest.raises(EngineDeadError, match=rf"not what the trainer sent: 1 of \d+ tensors differ \({first}: "):
            await update(b)
        assert engine.version == 2
        await assert_serves_nothing(engine)
    finally:
        await transport.aclose()
        await engine.aclose()
