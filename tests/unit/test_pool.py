"""The engine pool with fake engines: placement, one weight sync for all, failover."""

from __future__ import annotations

import asyncio

import pytest

from rollflow.engine import EngineOutput, WorkerCall
from rollflow.engine.pool import EnginePool, group_key
from rollflow.errors import EngineDeadError
from rollflow.records import Prompt, SamplingSpec
from rollflow.rollout import rollout
from rollflow.testing import FakeEngine

SPEC = SamplingSpec(max_tokens=12)


class Member(FakeEngine):
    """A fake engine that counts its requests and its loads, and can die."""

    def __init__(self, name: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.name = name
        self.requests: list[str] = []
        self.loads = 0
        self.dead = False

    async def stream(self, request_id, prompt_token_ids, sampling, *, deltas=True):
        self.requests.append(request_id)
        async for out in super().stream(request_id, prompt_token_ids, sampling, deltas=deltas):
            if self.dead:
                raise EngineDeadError(f"{self.name} died", partial=self.partial(request_id))
            yield out
        if self.dead:
            raise EngineDeadError(f"{self.name} died", partial=None)

    async def _step_wait(self, request_id, context_tokens):
        await super()._step_wait(request_id, context_tokens)
        if self.dead:
            raise EngineDeadError(f"{self.name} died", partial=self.partial(request_id))

    async def rpc(self, method, *args):
        if self.dead:
            raise EngineDeadError(f"{self.name} died")
        self.loads += 1
        return [method]

    async def check_health(self):
        if self.dead:
            raise EngineDeadError(f"{self.name} died")


def test_group_key():
    assert group_key("g12/3") == group_key("g12/3#2") == group_key("g12/t1/3") == "g12"


async def test_a_group_stays_on_one_engine_and_new_groups_go_to_the_least_loaded():
    a, b = Member("a", token_delay=0.001), Member("b", token_delay=0.001)
    pool = EnginePool([a, b])
    prompt = Prompt(id="p", token_ids=[1, 2, 3])
    groups = [
        [rollout(pool, prompt, SPEC, group_id=f"g{g}", index=i) for i in range(4)] for g in range(4)
    ]
    await asyncio.gather(*(s for group in groups for s in group))
    for g in range(4):
        owners = {m.name for m in (a, b) for r in m.requests if group_key(r) == f"g{g}"}
        assert len(owners) == 1  # every sample of the group on one engine
    assert len(a.requests) == len(b.requests) == 8  # the load is spread


async def test_one_weight_sync_loads_each_engine_once_inside_its_pause_with_one_version():
    a, b = Member("a"), Member("b")
    pool = EnginePool([a, b])
    seen = []

    async def load():
        (target,) = pool.targets()  # inside a member's critical section: that member only
        seen.append((target.name, target._running.is_set()))
        await pool.rpc("rollflow_load_path", "/x")

    assert await pool.update_weights_with(load) == 1
    assert sorted(seen) == [("a", False), ("b", False)]  # each loaded while paused
    assert (a.loads, b.loads) == (1, 1) and a.version == b.version == pool.version == 1
    assert await pool.update_weights_with(load, version=7) == 7 and a.version == b.version == 7
    assert pool.targets() == [a, b]  # outside an update: every engine


async def test_a_load_that_is_one_worker_call_reaches_each_member_as_that_call():
    a, b = Member("a"), Member("b")
    received = []

    class Sees(Member):
        async def update_weights_with(self, load, **kwargs):
            received.append(load)  # a member that can fuse it gets the call itself, not a closure
            return await super().update_weights_with(load, **kwargs)

    c = Sees("c")
    pool = EnginePool([a, b, c])
    call = WorkerCall("rollflow_receive", ("rollflow.weight_sync.shm:ShmReceiver", "segment", b"plan"))
    assert await pool.update_weights_with(call) == 1
    assert received == [call]
    assert (a.loads, b.loads, c.loads) == (1, 1, 1) and a.version == b.version == c.version == 1


async def test_a_dead_engine_is_taken_out_and_its_requests_finish_elsewhere():
    a, b = Member("a", token_delay=0.005), Member("b", token_delay=0.005)
    pool = EnginePool([a, b])
    prompt = Prompt(id="p", token_ids=[4, 5, 6])
    tasks = [asyncio.create_task(rollout(pool, prompt, SPEC, group_id=f"g{g}", index=0, partial="resume"))
             for g in range(4)]
    await asyncio.sleep(0.02)
    victim = a if any(r for r in a.requests) else b
    victim.dead = True
    samples = await asyncio.gather(*tasks)
    assert [m.name for m, _ in pool.taken_out] == [victim.name] and pool.members == [b if victim is a else a]
    for sample in samples:
        assert len(sample.completion_token_ids) == SPEC.max_tokens == len(sample.versions)
    assert any(s.interruptions for s in samples)  # the dead engine's requests were resubmitted
    # A weight sync now reaches the engine left, and a sync with every engine gone is an error.
    survivor = pool.members[0]
    assert await pool.update_weights_with(lambda: pool.rpc("load")) == 1 and survivor.version == 1
    survivor.dead = True
    with pytest.raises(EngineDeadError, match="every engine of the pool is gone"):
        await pool.check_health()


async def test_closing_the_pool_closes_the_engines_taken_out_too():
    """A remote engine taken out still holds its HTTP session, which only its `aclose` releases."""
    closed = []

    class Closing(Member):
        async def aclose(self):
            closed.append(self.name)

    a, b = Closing("a", token_delay=0.001), Closing("b", token_delay=0.001)
    pool = EnginePool([a, b])
    a.dead = True
    await rollout(pool, Prompt(id="p", token_ids=[1, 2]), SPEC, group_id="g0", index=0, partial="resume")
    assert [m.name for m, _ in pool.taken_out] == ["a"]
    await pool.aclose()
    assert sorted(closed) == ["a", "b"]


async def test_an_engine_dying_inside_the_sync_does_not_stall_the_others():
    a, b = Member("a"), Member("b")
    pool = EnginePool([a, b])
    b.dead = True

    async def pause_then_die(*, keep=True):
        raise EngineDeadError("b died while pausing")

    b.pause = pause_then_die  # type: ignore[method-assign]
    assert await asyncio.wait_for(pool.update_weights_with(lambda: pool.rpc("load")), 5) == 1
    assert pool.members == [a] and a.loads == 1

    async def broken():
        raise RuntimeError("bad bucket")

    with pytest.raises(RuntimeError, match="bad bucket"):
        await pool.update_weights_with(broken)
    assert a.version == 1


async def test_a_streaming_caller_gets_the_rest_as_preempted_with_every_version():
    pool = EnginePool([Member("a", token_delay=0.002), Member("b", token_delay=0.002)])
    seen: list[EngineOutput] = []
    async for out in pool.stream("g0/0", [1, 2], SPEC):
        seen.append(out)
        if len(seen) == 3:
            pool._owner["g0/0"].dead = True
    final = seen[-1]
    tokens = [t for out in seen for t in out.token_ids]
    assert final.finish_reason == "preempted" and final.versions == [0] * len(tokens) and len(tokens) >= 3
    assert len(pool.members) == 1


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (['engine.urls=["htp://x:1"]'], "engine.urls[0]: expected 'local' or a server address"),
        (['engine.urls=["local", "127.0.0.1:8000"]'], "engine.urls[1]: expected"),
        (['engine.urls=["local", "http://h:1"]', "run.weight_transport=nccl", "engine.weight_transfer=nccl"],
         "NCCL into several engines"),
        (['engine.urls=["http://h:1"]', "trainer.lora.enabled=true"], "needs one in-process engine"),
    ],
)
def test_engine_settings_that_cannot_work_are_refused_before_anything_starts(tmp_path, overrides, message):
    from rollflow.config import load_config
    from rollflow.controller import Controller
    from rollflow.errors import ConfigError

    with pytest.raises(ConfigError) as caught:
        Controller(load_config(preset="tiny", overrides=overrides), tmp_path)
    assert message in str(caught.value)
    assert not any(tmp_path.iterdir())  # nothing written
