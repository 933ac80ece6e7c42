"""Whole runs (fake engine and trainer) whose users' sync code hangs: a hung call costs its
episode, never the run, and a run whose every call hangs stops naming what hangs."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time

import openai
import pytest

from rollflow.config import load_config
from rollflow.controller import Controller
from rollflow.controller.setup import Given
from rollflow.errors import TrainingError
from rollflow.ledger import summarize
from rollflow.models import load_tokenizer, tiny_model_path
from rollflow.testing import FakeEngine, FakeTrainer, NullTransport


@pytest.fixture
def gate():
    """What the hanging calls wait on; set at teardown so their threads end with the test."""
    event = threading.Event()
    yield event
    event.set()


def _controller(tmp_path, *, overrides, **given):
    config = load_config(preset="tiny", overrides=["sampling.max_tokens=4", *overrides])
    return Controller(
        config,
        tmp_path,
        given=Given(engine=FakeEngine(), trainer=FakeTrainer(), transport=NullTransport(),
                    tokenizer=load_tokenizer(tiny_model_path(0))),
        **given,
    )


async def test_a_sync_agent_that_hangs_in_one_episode_of_eight_trains_every_step(tmp_path, gate):
    """Every 8th episode's agent blocks for good; the others make one ordinary call. The hung
    calls are abandoned at `env.episode_timeout_s` and the run trains all its steps: the hung
    threads neither starve the run's own thread work nor charge the healthy episodes queued
    behind them."""
    episodes = itertools.count()

    def agent(task, base_url):
        if next(episodes) % 8 == 7:
            gate.wait()
            return 0.0
        with openai.OpenAI(base_url=base_url, api_key=task.api_key, max_retries=0) as client:
            reply = client.chat.completions.create(model=task.model, messages=task.messages, max_tokens=4)
        return float(len(reply.choices[0].message.content or "") % 2)

    controller = _controller(
        tmp_path, agent=agent,
        overrides=["run.max_steps=6", "env.kind=agent", "env.episode_timeout_s=1", "run.stall_timeout_s=60"],
    )
    began = time.monotonic()
    result = await asyncio.wait_for(controller.run(), 120)
    assert result.steps == 6 and summarize(tmp_path).ok
    assert next(episodes) >= 8 * 6, "fewer episodes than the steps needed"
    assert time.monotonic() - began < 90


async def test_a_run_whose_every_sync_agent_call_hangs_stops_naming_the_callable(tmp_path, gate):
    """Every episode hangs: the run stops within `run.stall_timeout_s` (plus a margin), its error
    names the timeout, and it does not wait for the hung threads to return."""

    def hangs(task, base_url):
        gate.wait()

    controller = _controller(
        tmp_path, agent=hangs,
        overrides=["run.max_steps=4", "env.kind=agent", "env.episode_timeout_s=0.5", "run.stall_timeout_s=5"],
    )
    began = time.monotonic()
    with pytest.raises(TrainingError) as stopped:
        await asyncio.wait_for(controller.run(), 60)
    assert time.monotonic() - began < 5 + 30
    message = str(stopped.value)
    assert "timed out after 0.5 s (env.episode_timeout_s)" in message or "hangs" in message, message


async def test_a_part_whose_close_hangs_or_raises_is_named_and_the_rest_still_close(tmp_path, monkeypatch, caplog):
    """A reward function whose `aclose` hangs, and one whose `aclose` raises: the run still
    returns, the engine still closes, and each is named in the log."""
    import rollflow.controller.run as run_module

    monkeypatch.setattr(run_module, "CLOSE_TIMEOUT_S", 0.5)  # the bound the controller passes

    class Hangs:
        __name__ = "hangs"

        def __call__(self, prompts, completions, **kwargs):
            return [1.0] * len(completions)

        async def aclose(self):
            await asyncio.sleep(3600)

    class Raises(Hangs):
        __name__ = "raises"

        async def aclose(self):
            raise OSError("socket already gone")

    closed = []

    class Engine(FakeEngine):
        async def aclose(self):
            closed.append("engine")
            await super().aclose()

    config = load_config(preset="tiny", overrides=["sampling.max_tokens=4", "run.max_steps=2"])
    controller = Controller(config, tmp_path, reward_funcs={"hangs": Hangs()},
                            given=Given(engine=Engine(), trainer=FakeTrainer(), transport=NullTransport()))
    result = await asyncio.wait_for(controller.run(), 60)
    assert result.steps == 2 and closed == ["engine"]
    assert "closing the reward scorer: it did not close within 0.5 s" in caplog.text

    controller = Controller(config, tmp_path / "b", reward_funcs={"raises": Raises()},
                            given=Given(engine=Engine(), trainer=FakeTrainer(), transport=NullTransport()))
    await asyncio.wait_for(controller.run(), 60)
    assert closed == ["engine", "engine"]
    assert "closing the reward scorer: it raised OSError: socket already gone" in caplog.text


@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_an_agent_that_calls_sys_exit_costs_its_episode_not_the_run(tmp_path, kind):
    """`sys.exit()` in user code is that episode's failure, named; the run trains on."""
    import sys

    episodes = itertools.count()

    def answer(task, base_url):
        with openai.OpenAI(base_url=base_url, api_key=task.api_key, max_retries=0) as client:
            client.chat.completions.create(model=task.model, messages=task.messages, max_tokens=4)
        return 1.0

    def sync_agent(task, base_url):
        if next(episodes) % 8 == 7:
            sys.exit(3)
        return answer(task, base_url)

    async def async_agent(task, base_url):
        if next(episodes) % 8 == 7:
            sys.exit(3)
        return await asyncio.to_thread(answer, task, base_url)

    controller = _controller(
        tmp_path, agent=sync_agent if kind == "sync" else async_agent,
        overrides=["run.max_steps=3", "env.kind=agent", "env.episode_timeout_s=10"],
    )
    result = await asyncio.wait_for(controller.run(), 120)
    assert result.steps == 3 and summarize(tmp_path).ok


async def test_a_reward_function_or_environment_step_that_calls_sys_exit_is_that_samples_reason(chat):
    import sys

    from rollflow.envs import EnvStep, EpisodeLimits, run_episode
    from rollflow.records import Message, Prompt, SamplingSpec
    from rollflow.scoring import Reward, Scorer
    from rollflow.testing import ScriptedTurns

    def exits(prompts, completions, **kwargs):
        sys.exit(4)

    scorer = Scorer([Reward(name="exits", func=exits)])
    prompt = Prompt(id="p", token_ids=[1], messages=[Message(role="user", content="hi")])
    (scored,) = await scorer.score(prompt, ["x"], [[1]])
    assert scored.reward is None and scored.reason == "reward exits: called sys.exit(4)"

    class Exits:
        async def reset(self, prompt):
            return list(prompt.messages)

        async def step(self, turn):
            sys.exit(5)
            return EnvStep(done=True)

    sample = await run_episode(Exits(), prompt, SamplingSpec(temperature=1.0, max_tokens=8),
                               ScriptedTurns(chat, ["a"]), chat, group_id="g", index=0, limits=EpisodeLimits())
    assert sample.unscorable == "environment: step called sys.exit(5)"


async def test_a_run_whose_stuck_calls_fill_the_guest_pool_stops_naming_the_callable(tmp_path, gate, monkeypatch):
    """Every agent call hangs past its timeout: once the stuck threads leave the pool only its size
    below its cap, the run stops with one line naming the callable and how many of its calls are
    stuck (a small cap here, so it fires before the stop rule's count of failed groups)."""
    import rollflow.guest

    monkeypatch.setattr(rollflow.guest, "CAP_PER_SIZE", 1.25)  # 32 samples in flight: cap 40, stop at 8 stuck

    def hangs(task, base_url):
        gate.wait()

    controller = _controller(
        tmp_path, agent=hangs,
        overrides=["run.max_steps=4", "env.kind=agent", "env.episode_timeout_s=0.3", "run.stall_timeout_s=60"],
    )
    with pytest.raises(TrainingError) as stopped:
        await asyncio.wait_for(controller.run(), 60)
    message = str(stopped.value)
    assert message.startswith("user code is stuck: ") and " calls of agent " in message and "hangs" in message
