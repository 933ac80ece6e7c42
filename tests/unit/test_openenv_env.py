"""OpenEnv environments as episodes, with scripted model turns: a real OpenEnv server (the test
environment in examples/environments/openenv_sums.py, served by uvicorn in its own process, as
rollflow starts it) and its own WebSocket client; only the model's turns are scripted. Training
real vLLM against it is in tests/integration/test_environments.py."""

from __future__ import annotations

import asyncio
import time

import pytest

from rollflow.controller.setup import Given
from rollflow.envs import EpisodeLimits, run_episode
from rollflow.envs.openenv import OpenEnvSource, episode_seed, observation_text, text_action
from rollflow.errors import ConfigError
from rollflow.records import Message, Prompt, SamplingSpec
from rollflow.testing import ScriptedTurns, unused_port

pytestmark = pytest.mark.usefixtures("example_environments")

SPEC = SamplingSpec(temperature=1.0, max_tokens=32)
LIMITS = EpisodeLimits(max_turns=4, max_tokens=256, step_timeout_s=10)


@pytest.fixture(scope="module")
async def served(request):
    """The example server, started by an `OpenEnvSource` as a run starts it, once for the module:
    its address."""
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(request.config.rootpath / "examples" / "environments"))
        import openenv_sums

        starter = OpenEnvSource(openenv_sums.SumsClient, server="openenv_sums:app", timeout_s=10)
        await starter.start()
    yield starter.url
    await starter.aclose()


@pytest.fixture
async def source(served):
    """A source of 4 sessions with the module's server, fresh for each test."""
    import openenv_sums

    source = OpenEnvSource(openenv_sums.SumsClient, url=served, sessions=4, timeout_s=10)
    await source.start()
    yield source
    await source.aclose()


def question(prompt_id: str) -> tuple[str, int]:
    """What the test server asks for this prompt's episodes, and the answer."""
    import openenv_sums

    observation = openenv_sums.SumsEnvironment().reset(seed=episode_seed(prompt_id))
    a, b = [int(x) for x in observation.text.removesuffix("?").split() if x.isdigit()]
    return observation.text, a + b


PROMPT = Prompt(id="sums-0", token_ids=[1], messages=[Message(role="system", content="Be brief.")])


async def test_a_right_first_answer_ends_the_episode_with_the_server_reward(chat, source):
    text, answer = question(PROMPT.id)
    script = ScriptedTurns(chat, [str(answer)])
    sample = await run_episode(await source(), PROMPT, SPEC, script, chat, group_id="g", index=0, limits=LIMITS)
    assert sample.unscorable is None and sample.turns == 1
    assert sample.process_rewards == [(sample.num_tokens - 1, 1.0)]
    # the opening is the prompt's system message and the reset observation as the user's
    opening = chat.render([Message(role="system", content="Be brief."), Message(role="user", content=text)])
    assert sample.prompt_token_ids == chat.tokens(opening) == script.seen[0]


async def test_a_wrong_answer_gets_the_observation_as_the_next_message(chat, source):
    _, answer = question(PROMPT.id)
    script = ScriptedTurns(chat, ["no idea", f"It is {answer}"])
    sample = await run_episode(await source(), PROMPT, SPEC, script, chat, group_id="g", index=0, limits=LIMITS)
    assert sample.unscorable is None and sample.turns == 2
    assert [r for _, r in sample.process_rewards] == [0.0, 1.0]
    first = [*chat.tokens("no idea"), chat.tokenizer.eos_token_id]
    feedback = sample.completion_token_ids[len(first) : len(script.seen[1]) - len(sample.prompt_token_ids)]
    assert "Not right. Try again." in chat.tokenizer.decode(feedback)
    assert sample.loss_mask[: len(first)] == [1] * len(first)
    assert set(sample.loss_mask[len(first) : len(first) + len(feedback)]) == {0}


async def test_a_group_meets_one_instance_and_sessions_are_released(chat, source):
    seen = set()
    for index in range(6):  # more episodes than the 4 sessions: each gives its session back
        script = ScriptedTurns(chat, ["0", "0"])
        sample = await run_episode(await source(), PROMPT, SPEC, script, chat, group_id="g", index=index, limits=LIMITS)
        seen.add(chat.tokenizer.decode(sample.prompt_token_ids))
        assert sample.unscorable is None
    assert len(seen) == 1
    assert len(source.idle) == 1  # one after another, the episodes reset one kept session


async def test_waiting_for_a_free_session_is_not_the_environments_time(chat, served, tmp_path):
    """Episodes queued behind busy sessions wait for one without a step timeout: only the
    environment's own calls are bounded by `env.step_timeout_s`."""
    import asyncio

    import openenv_sums

    from rollflow.config import load_config
    from rollflow.controller import Controller
    from rollflow.testing import FakeEngine, FakeTrainer, NullTransport

    config = load_config(preset="tiny", overrides=[
        "run.max_steps=1", "sampling.max_tokens=8", "env.kind=tool", "env.max_turns=1", "env.step_timeout_s=0.5"])
    # 2 sessions for 32 episodes in flight, each holding its session for about 0.25 s of model turn
    source = OpenEnvSource(openenv_sums.SumsClient, url=served, sessions=2, timeout_s=0.5)
    controller = Controller(
        config,
        tmp_path,
        env=source,
        given=Given(
            engine=FakeEngine(token_delay=0.03),
            trainer=FakeTrainer(),
            transport=NullTransport(),
            tokenizer=chat.tokenizer,
        ),
    )
    result = await asyncio.wait_for(controller.run(), 60)
    assert result.steps == 1 and result.metrics[0]["unscorable"] == 0
    assert "unscorable" not in result.dropped, (tmp_path / "ledger.jsonl").read_text()[:400]


async def test_a_session_whose_call_was_cut_off_is_closed_not_kept(chat, source, monkeypatch):
    import asyncio

    import openenv_sums

    async def slow_step(self, action):
        await asyncio.sleep(5)

    monkeypatch.setattr(openenv_sums.SumsClient, "step", slow_step)
    limits = EpisodeLimits(max_turns=2, max_tokens=64, step_timeout_s=0.5)
    sample = await run_episode(
        await source(), PROMPT, SPEC, ScriptedTurns(chat, ["1"]), chat, group_id="g", index=0, limits=limits
    )
    assert sample.unscorable == "environment: step timed out after 0.5 s"
    assert source.idle == []


async def test_an_action_that_cannot_be_made_makes_the_episode_unscorable(chat, source):
    def refuse(text: str):
        raise ValueError("not an action")

    source.to_action = refuse
    sample = await run_episode(
        await source(), PROMPT, SPEC, ScriptedTurns(chat, ["1"]), chat, group_id="g", index=0, limits=LIMITS
    )
    assert sample.unscorable == "environment: step raised ValueError: not an action"


async def test_an_unreachable_server_is_named_within_seconds():
    import openenv_sums

    url = f"http://127.0.0.1:{unused_port()}"
    began = time.monotonic()
    with pytest.raises(ConfigError, match=rf"env.url: no OpenEnv server answers at {url}"):
        await OpenEnvSource(openenv_sums.SumsClient, url=url).start()
    assert time.monotonic() - began < 6


async def test_a_server_that_cannot_start_is_named_with_its_output():
    import openenv_sums

    source = OpenEnvSource(openenv_sums.SumsClient, server="no_such_module:app")
    with pytest.raises(ConfigError, match=r"(?s)'no_such_module:app' exited at start:.*no_such_module"):
        await source.start()
    await source.aclose()


def test_text_becomes_the_client_action_and_an_observation_text():
    import openenv_sums

    action = text_action(openenv_sums.SumsClient)("12")
    assert isinstance(action, openenv_sums.SumsAction) and action.message == "12"
    assert observation_text(openenv_sums.SumsObservation(text="hi", reward=1.0)) == "hi"
    assert observation_text({"a": 1, "b": "x", "done": False}) == '{"a": 1, "b": "x"}'


def test_a_client_without_a_text_action_asks_for_a_function():
    from openenv.core.generic_client import GenericEnvClient

    with pytest.raises(ConfigError, match="env.action: GenericEnvClient declares no pydantic action class"):
        text_action(GenericEnvClient)
    with pytest.raises(ConfigError, match="not an OpenEnv client"):
        OpenEnvSource(dict, url="http://127.0.0.1:1")


KILLED = """
import asyncio, sys, time
sys.path.insert(0, sys.argv[1])
import openenv_sums
from rollflow.envs.openenv import OpenEnvSource

async def main():
    source = OpenEnvSource(openenv_sums.SumsClient, server="openenv_sums:app")
    await source.start()
    print(source.url, flush=True)
    await asyncio.sleep(600)

asyncio.run(main())
"""


async def test_the_server_a_run_started_dies_with_it_even_on_sigkill(request):
    """A run killed outright (SIGKILL, out of memory) runs no cleanup: the OpenEnv server it
    started notices that its parent is gone and exits, as the vLLM engine does."""
    import asyncio
    import signal
    import subprocess
    import sys

    import aiohttp

    folder = str(request.config.rootpath / "examples" / "environments")
    run = subprocess.Popen([sys.executable, "-c", KILLED, folder], stdout=subprocess.PIPE, text=True)
    try:
        assert run.stdout is not None
        url = run.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:")
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{url}/health") as reply:
                assert reply.status == 200
            run.send_signal(signal.SIGKILL)
            run.wait(10)
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                try:
                    async with session.get(f"{url}/health", timeout=aiohttp.ClientTimeout(total=1)):
                        pass
                except (aiohttp.ClientError, TimeoutError):
                    break  # nothing answers: the server is gone
                await asyncio.sleep(0.2)
            else:
                pytest.fail(f"the server at {url} still answers 15 s after its run was killed")
    finally:
        run.kill()
        run.wait()


def test_openenv_and_openenv_core_installed_together_are_refused_naming_both(monkeypatch):
    """Both distributions install the `openenv` module: with both, which files are there is
    anyone's guess, so the run refuses in one line saying what to do."""
    from importlib import metadata

    from rollflow.envs import openenv

    real = metadata.version
    versions = {"openenv": "0.10.0", "openenv-core": "0.3.0"}

    def version(name):
        if name in ("openenv", "openenv-core"):
            if name not in versions:
                raise metadata.PackageNotFoundError(name)
            return versions[name]
        return real(name)

    monkeypatch.setattr(metadata, "version", version)
    with pytest.raises(ConfigError, match=r"both openenv 0.10.0 and openenv-core 0.3.0 are installed.*pip uninstall"):
        openenv._library()
    versions.pop("openenv-core")
    assert openenv._library().__name__ == "EnvClient"


async def test_a_users_action_and_observation_functions_run_off_the_event_loop(chat, source):
    """`env.action` and `env.observation` are the user's code: one that blocks holds its episode,
    never the event loop every other episode needs."""
    def slow_action(text: str):
        time.sleep(0.6)
        return source_action(text)

    source_action = source.to_action
    source.to_action = slow_action
    gaps: list[float] = []

    async def heartbeat():
        last = time.monotonic()
        while True:
            await asyncio.sleep(0.02)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    beat = asyncio.create_task(heartbeat())
    try:
        sample = await run_episode(
            await source(), PROMPT, SPEC, ScriptedTurns(chat, ["1"] * 4), chat, group_id="g", index=0, limits=LIMITS
        )
    finally:
        beat.cancel()
    assert sample.unscorable is None
    assert max(gaps) < 0.4, f"the event loop was held for {max(gaps):.2f} s"
