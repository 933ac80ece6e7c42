"""Weight sync into the live vLLM engine: every CPU transport, live streams, stale KV, dead peers."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from rollflow.errors import WeightSyncError
from rollflow.records import SamplingSpec
from rollflow.testing import unused_port
from rollflow.weight_sync import make_transport, plan_for, sync_weights
from rollflow.weight_sync.gloo import RECEIVER as GLOO_RECEIVER

pytestmark = pytest.mark.integration

PROMPT = [1, 735, 202, 276, 261, 264, 277, 281, 34, 2, 202, 1, 871, 202]
LONG = 160
"""Tokens of a rollout an update interrupts: long enough that an update sent after its first few
tokens (staging included) lands mid-stream however fast the machine generates."""
GREEDY = SamplingSpec(temperature=0.0, max_tokens=20, ignore_eos=True)
HERE = Path(__file__).parent



async def greedy(engine, prompt=PROMPT, tag="g") -> list[int]:
    out = await engine.generate(prompt, GREEDY, f"{tag}-{time.monotonic_ns()}")
    return out.token_ids


@pytest.mark.parametrize("name", ["gloo", "shm", "checkpoint"])
async def test_transport_switches_weights_a_b_a(engine_on_a, model_a, model_b, name):
    engine = engine_on_a
    transport = make_transport(name)
    try:
        want_a, want_b = model_a.greedy(PROMPT, 20)[0], model_b.greedy(PROMPT, 20)[0]
        for state, want in ((model_b.state_dict(), want_b), (model_a.state_dict(), want_a),
                            (model_b.state_dict(), want_b)):
            before = engine.version
            # Small buckets so even the tiny model spans several of them.
            plan = plan_for(state, bucket_bytes=128 * 1024)
            assert len(plan.bucket_sizes) > 3
            assert await sync_weights(engine, transport, plan, state.items()) == before + 1
            assert await greedy(engine) == want
            # Every stage of the critical section is timed (bench/weight_update.py reads them): a
            # load that is one worker call runs in one engine-core call with the label and reset;
            # in the default `staged` layout, one of shm views (names and shapes loaded before) is
            # staged first while the engine generates.
            if name == "gloo":  # the worker receives while this process sends: in stages
                assert list(engine.last_update_s) == ["pause", "load", "label", "reset prefix cache", "resume"]
            elif name == "shm":
                assert list(engine.last_update_s) == [
                    "update", "stage", "load", "label", "reset prefix cache", "engine core"
                ]
            else:  # files are loaded whole
                assert list(engine.last_update_s) == ["update", "load", "label", "reset prefix cache", "engine core"]
            if name != "gloo":  # the engine core's own time is within the call, as its caller sees it
                assert engine.last_update_s["engine core"] <= engine.last_update_s["update"]
            assert all(0 <= s < 60 for s in engine.last_update_s.values())
    finally:
        await transport.aclose()


async def test_gloo_sends_only_what_changed_and_the_engine_holds_exactly_it(engine_on_a, model_b):
    """After the first sync, a sync over gloo carries only the changed elements (here one row of
    the LM head: the one the first greedy token is drawn from), and the engine's greedy output is
    that of the changed weights; each load is checked against the trainer side's fingerprint."""
    from transformers import AutoModelForCausalLM

    from rollflow.engine import fingerprint
    from rollflow.models import tiny_model_path
    from rollflow.testing import greedy_tokens
    from rollflow.weight_sync import publish

    engine, transport = engine_on_a, make_transport("gloo")
    b = model_b.state_dict()
    changed = {name: tensor.clone() for name, tensor in b.items()}
    changed["lm_head.weight"][model_b.greedy(PROMPT, 1)[0][0]] -= 100.0
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_path(1), dtype=torch.float32)
    reference.load_state_dict(changed)
    plan = plan_for(b)
    try:
        sent = []
        for state in (b, changed):
            await transport.stage(plan, state.items())
            await publish(engine, transport, plan, expect=fingerprint.of(state.items()))
            sent += [sender.last_sent for sender in transport._senders.values()]
        assert sent[0] == plan.total_bytes
        width = changed["lm_head.weight"].shape[1]
        assert sent[1] < 8 * width + 8 * 2 * len(plan.tensors) + 64  # indices, values and the header
        assert await greedy(engine) == greedy_tokens(reference.eval(), PROMPT, GREEDY.max_tokens)
    finally:
        await transport.aclose()


async def test_sync_during_a_live_stream_switches_versions_at_the_boundary(
    engine_on_a, model_a, model_b, streaming
):
    engine = engine_on_a
    transport = make_transport("gloo")
    v = engine.version
    try:
        await transport.connect(engine)
        task = await streaming(engine, PROMPT, "live", LONG)
        state = model_b.state_dict()
        await sync_weights(engine, transport, plan_for(state), state.items())
        sample = await task
    finally:
        await transport.aclose()
    assert_switched_once(sample, v, model_a, model_b)


def assert_switched_once(sample, v: int, model_a, model_b, n: int = LONG) -> None:
    """Versions v then v + 1 with the boundary inside; A's greedy tokens before it, B's after."""
    k = sample.versions.index(v + 1)
    assert 0 < k < n and sample.versions == [v] * k + [v + 1] * (n - k)
    assert sample.completion_token_ids[:k] == model_a.greedy(PROMPT, k)[0]
    assert sample.completion_token_ids[k:] == model_b.greedy(PROMPT + sample.completion_token_ids[:k], n - k)[0]


@pytest.mark.parametrize("partial", ["keep", "resume"])
async def test_plain_layout_loads_in_place_and_switches_versions_at_the_boundary(
    engine, plain_engine, model_a, model_b, partial, streaming
):
    """`engine.linear_layout = "plain"`: the worker copies into the model's own tensors (the
    packed engine reloads layer by layer), in one engine-core call with no pause; a request
    generating across the update is exactly A's tokens, then B's from that prefix. Loads from
    files stream through the model's loader."""
    assert await plain_engine.rpc("rollflow_loads_in_place") == [True]
    assert await engine.rpc("rollflow_loads_in_place") == [False]
    transport = make_transport("shm")
    v = plain_engine.version
    try:
        task = await streaming(plain_engine, PROMPT, f"live-{partial}", LONG)
        state = model_b.state_dict()
        await sync_weights(plain_engine, transport, plan_for(state), state.items(), partial=partial)
        assert list(plain_engine.last_update_s) == ["update"] + ["abort"] * (partial != "keep") + [
            "load",
            "label",
            "reset prefix cache",
            "engine core",
        ]
        sample = await task
        assert await greedy(plain_engine) == model_b.greedy(PROMPT, 20)[0]
        state = model_a.state_dict()
        await sync_weights(plain_engine, transport, plan_for(state), state.items())
        assert await greedy(plain_engine) == model_a.greedy(PROMPT, 20)[0]
        # The first load was watched; the later ones copied each tensor where it put it.
        assert await plain_engine.rpc("rollflow_copy_plans") == [1]
        # From files, one tensor at a time through the model's loader (nothing replayed).
        files = make_transport("checkpoint")
        try:
            for model in (model_b, model_a):
                state = model.state_dict()
                await sync_weights(plain_engine, files, plan_for(state), state.items())
                assert await greedy(plain_engine) == model.greedy(PROMPT, 20)[0]
        finally:
            await files.aclose()
        assert await plain_engine.rpc("rollflow_copy_plans") == [1]
    finally:
        await transport.aclose()
    assert_switched_once(sample, v, model_a, model_b)


@pytest.mark.parametrize("partial", ["keep", "resume"])
async def test_staged_layout_stages_while_generating_and_switches_versions_at_the_boundary(
    engine_on_a, model_a, model_b, partial, streaming
):
    """`engine.linear_layout = "staged"` (the default): the first load of a set of names and
    shapes is made whole in the critical section (and watched); later ones are copied and packed
    on a thread of the engine process while it generates, and the one engine-core call only
    commits them. A request generating across the commit is exactly A's tokens, then B's."""
    engine = engine_on_a
    assert engine.config.linear_layout == "staged"
    assert await engine.rpc("rollflow_stages_updates") == [True]
    transport = make_transport("shm")
    try:
        for model in (model_b, model_a):
            state = model.state_dict()
            await sync_weights(engine, transport, plan_for(state), state.items())
            assert await greedy(engine) == model.greedy(PROMPT, 20)[0]
        assert "stage" in engine.last_update_s  # at least the second (a first one is made whole)
        v = engine.version
        task = await streaming(engine, PROMPT, f"staged-{partial}", LONG)
        state = model_b.state_dict()
        await sync_weights(engine, transport, plan_for(state), state.items(), partial=partial)
        assert {"stage", "update", "load", "label", "reset prefix cache"} <= set(engine.last_update_s)
        sample = await task
        assert await greedy(engine) == model_b.greedy(PROMPT, 20)[0]
        # Safetensors bytes of the same names and shapes stage through the same plan.
        await engine.update_weights(model_a.state_dict())
        assert "stage" in engine.last_update_s
        assert await greedy(engine) == model_a.greedy(PROMPT, 20)[0]
    finally:
        await transport.aclose()
    assert_switched_once(sample, v, model_a, model_b)


async def test_stale_prefix_cache_bug_appears_without_both_guards(engine_on_a, model_a, model_b):
    """A prompt longer than a KV block, cached under A, then B loaded: without a prefix-cache
    reset and without version salting, B reuses A's KV and generates something else."""
    engine = engine_on_a
    long_prompt = (PROMPT * 30)[:400]
    want_b = model_b.greedy(long_prompt, 20)[0]
    results = {}
    try:
        for salt, reset in ((False, False), (True, False), (False, True)):
            engine.salt_prefix_cache, engine.reset_prefix_cache_on_update = salt, reset
            await engine.update_weights(model_a.state_dict())
            await greedy(engine, long_prompt, "warm")  # caches the prompt's blocks under A
            await engine.update_weights(model_b.state_dict())
            results[(salt, reset)] = await greedy(engine, long_prompt, "after")
    finally:
        engine.salt_prefix_cache = engine.reset_prefix_cache_on_update = True
    assert results[(False, False)] != want_b  # the bug, reproduced
    assert results[(True, False)] == want_b  # salting alone prevents it
    assert results[(False, True)] == want_b  # the reset alone prevents it


async def _start_receiving(engine, port: int):
    """Join the sender's gloo group, then run a receive inside the critical section."""
    return asyncio.create_task(
        engine.update_weights_with(lambda: engine.rpc("rollflow_receive", GLOO_RECEIVER), deadline_s=30)
    )


@pytest.mark.parametrize("fault", ["killed", "stalled"])
async def test_dead_or_stalled_sender_fails_within_deadline_and_engine_keeps_old_weights(engine_on_a, model_a, fault):
    engine = engine_on_a
    want_a = model_a.greedy(PROMPT, 20)[0]
    version = engine.version
    port = unused_port()
    sender = subprocess.Popen(
        [sys.executable, str(HERE / "weight_sender.py"), "slow", str(port), str(64 * 1024), "0.2", "3"],
        stdout=subprocess.PIPE, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    try:
        # Join only once the sender listens: its start (imports, weights) can outlast the join's
        # 10 s on a loaded machine, and that timeout is also the group's, which bounds the stall.
        assert (await asyncio.to_thread(sender.stdout.readline)).startswith("listening")
        await engine.rpc("rollflow_open_receiver", GLOO_RECEIVER, "127.0.0.1", port, 10.0)
        began = time.monotonic()
        update = await _start_receiving(engine, port)
        line = await asyncio.to_thread(sender.stdout.readline)
        assert line.startswith("connected")
        assert (await asyncio.to_thread(sender.stdout.readline)).startswith("bucket")  # mid-transfer
        if fault == "killed":
            sender.kill()
        with pytest.raises(WeightSyncError) as info:
            await update
        elapsed = time.monotonic() - began
    finally:
        sender.kill()
        sender.wait()
    assert elapsed < 30
    assert f"the engine keeps version {version}" in str(info.value)
    assert engine.version == version
    assert await greedy(engine) == want_a  # old weights, still serving


async def test_two_fsdp2_ranks_sync_into_the_engine(engine_on_a, model_a, tmp_path, make_batch, torchrun):
    """Two trainer ranks step under FSDP2, gather in lockstep, and rank 0 sends over gloo."""
    import msgspec

    from rollflow.models import tiny_model_path
    from rollflow.trainer import Trainer

    engine = engine_on_a
    port = unused_port()
    out_file, batch_file = tmp_path / "weights.pt", tmp_path / "batch.msgpack"
    batch_file.write_bytes(msgspec.msgpack.encode(make_batch(Trainer(tiny_model_path(0)), n=4)))
    ranks = subprocess.Popen(
        [*torchrun, str(HERE / "weight_sender.py"), "fsdp", str(port), str(out_file),
         str(batch_file)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo"),
    )
    try:
        # Rank 0 serves the rendezvous once it has stepped; joining retries until it is up.
        join = asyncio.create_task(engine.rpc("rollflow_open_receiver", GLOO_RECEIVER, "127.0.0.1", port, 60.0))
        exited = asyncio.create_task(asyncio.to_thread(ranks.wait))
        await asyncio.wait([join, exited], return_when=asyncio.FIRST_COMPLETED)
        assert join.done(), f"trainer ranks exited early: {ranks.stderr.read()[-3000:]}"
        receive = lambda: engine.rpc("rollflow_receive", GLOO_RECEIVER)  # noqa: E731
        version = await engine.update_weights_with(receive, deadline_s=120)
        _, stderr = await asyncio.to_thread(ranks.communicate, timeout=120)
        assert ranks.returncode == 0, stderr[-3000:]
    finally:
        ranks.kill()
        await exited
    trained = torch.load(out_file)
    model_a.model.load_state_dict(trained)  # the HF reference now holds the trained weights
    try:
        assert version == engine.version
        assert await greedy(engine) == model_a.greedy(PROMPT, 20)[0]
    finally:
        from safetensors.torch import load_file

        model_a.model.load_state_dict(load_file(tiny_model_path(0) / "model.safetensors"))
