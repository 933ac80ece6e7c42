"""verifiers environments through the agents' endpoint, with scripted model turns: the real
verifiers package and its rollout and rubric, the real aiohttp server and openai client, the tiny
model's tokenizer; only the model's turns are scripted, so every recorded token can be checked.
Training real vLLM on them is in tests/integration/test_environments.py."""

from __future__ import annotations

import pytest

from rollflow.agent import AgentEpisode, run_agent, task_of
from rollflow.envs import EpisodeLimits
from rollflow.errors import ConfigError
from rollflow.records import Prompt, Sample, SamplingSpec
from rollflow.testing import ScriptedTurns
from rollflow.verifiers.environments import VerifiersEnv

pytestmark = pytest.mark.usefixtures("example_environments")

SPEC = SamplingSpec(temperature=1.0, max_tokens=64)


async def play(env: VerifiersEnv, agent_server, chat, row_index: int, turns: list[str]) -> Sample:
    row = env.rows()[row_index]
    prompt = Prompt(id=row.id, token_ids=[1], messages=row.messages, answer=row.answer, task=row.task,
                    metadata=row.metadata)
    episode = AgentEpisode(prompt, SPEC, ScriptedTurns(chat, turns, version=3), chat, EpisodeLimits(max_tokens=512))
    try:
        return await run_agent(env, episode, agent_server, group_id="g0", index=0, timeout_s=30)
    finally:
        await env.aclose()


def test_the_dataset_becomes_rows_with_what_the_rollout_needs():
    env = VerifiersEnv("vf-sums", {"n": 5})
    rows = env.rows()
    assert len(rows) == 5 and rows[0].id == "vf-sums-0"
    assert [m.role for m in rows[0].messages] == ["system", "user"]
    assert rows[0].messages[0].content == "Answer with a number." and rows[0].answer.isdigit()
    assert rows[0].metadata == {"verifiers": {"example_id": 0, "info": {}}}
    task = task_of(Prompt(id=rows[0].id, token_ids=[1], messages=rows[0].messages, answer=rows[0].answer,
                          task=rows[0].task, metadata=rows[0].metadata), "tiny")
    assert task.messages[-1]["content"].startswith("What is")


@pytest.mark.parametrize(("reply", "reward"), [("right", 1.5), ("wrong", 0.0)])
async def test_a_single_turn_episode_is_scored_by_the_environment_rubric(chat, agent_server, reply, reward):
    env = VerifiersEnv("vf-sums", {"n": 4})
    answer = env.rows()[0].answer
    text = answer if reply == "right" else "none"
    sample = await play(env, agent_server, chat, 0, [text])
    assert sample.unscorable is None
    # correct (weight 1) + digits share (weight 0.5): "12" is all digits
    assert sample.process_rewards == [(sample.num_tokens - 1, reward)]
    assert sample.completion_token_ids == [*chat.tokens(text), chat.tokenizer.eos_token_id]
    assert set(sample.versions) == {3} and sample.loss_mask == [1] * sample.num_tokens


async def test_a_tool_episode_runs_the_environment_tool_and_masks_its_result(chat, agent_server):
    env = VerifiersEnv("vf-calc")
    row = env.rows()[0]
    a, b = [int(x) for x in row.messages[-1].content.split("?")[0].split() if x.isdigit()]
    call = f'<tool_call>{{"name": "add", "arguments": {{"a": {a}, "b": {b}}}}}</tool_call>'
    sample = await play(env, agent_server, chat, 0, [call, f"The sum is {a + b}"])
    assert sample.unscorable is None and sample.turns == 2
    assert sample.process_rewards[-1][1] == 1.0
    first = [*chat.tokens(call), chat.tokenizer.eos_token_id]
    last = [*chat.tokens(f"The sum is {a + b}"), chat.tokenizer.eos_token_id]
    tool = sample.completion_token_ids[len(first) : sample.num_tokens - len(last)]
    assert sample.completion_token_ids == first + tool + last
    assert str(a + b) in chat.tokenizer.decode(tool)  # the environment's own tool ran
    assert sample.loss_mask == [1] * len(first) + [0] * len(tool) + [1] * len(last)


async def test_a_rollout_that_fails_makes_its_episode_unscorable_with_the_reason(chat, agent_server):
    env = VerifiersEnv("vf-sums", {"n": 2})
    env.sampling_args = {"presence_penalty": 1.0}  # the endpoint refuses it: the model call fails
    sample = await play(env, agent_server, chat, 0, ["12"])
    assert sample.reward is None and sample.unscorable is not None
    assert "verifiers rollout of 'vf-sums' failed" in sample.unscorable


def test_unknown_and_broken_environments_are_refused_with_their_names():
    with pytest.raises(ConfigError, match=r"no verifiers environment 'vf-sumz' is installed.*did you mean 'vf_sums'"):
        VerifiersEnv("vf-sumz")
    with pytest.raises(ConfigError, match=r"'vf-sums' could not be loaded: TypeError: .*unexpected keyword"):
        VerifiersEnv("vf-sums", {"rows": 3})


BAD_ENVIRONMENTS = {
    "vf_judge_down": """
import verifiers as vf
from datasets import Dataset

def load_environment():
    def judge(completion, answer, **kwargs) -> float:
        raise RuntimeError("the judge is down")

    def length(completion, **kwargs) -> float:
        return 1.0

    rows = [{"question": "What is 1 + 1?", "answer": "2"}]
    return vf.SingleTurnEnv(dataset=Dataset.from_list(rows), rubric=vf.Rubric(funcs=[judge, length]))
""",
    "vf_slow_judge": """
import time
import verifiers as vf
from datasets import Dataset

def load_environment():
    def judge(completion, answer, **kwargs) -> float:
        time.sleep(3)  # a synchronous call to a slow service
        return 1.0

    rows = [{"question": "What is 1 + 1?", "answer": "2"}]
    return vf.SingleTurnEnv(dataset=Dataset.from_list(rows), rubric=vf.Rubric(funcs=[judge]))
""",
    "vf_exits": """
import sys
sys.exit(0)
""",
    "vf_not_an_env": """
def load_environment():
    return {"dataset": []}
""",
}


@pytest.fixture
def bad_environments(tmp_path, monkeypatch):
    for name, source in BAD_ENVIRONMENTS.items():
        (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))


@pytest.mark.usefixtures("bad_environments")
async def test_a_rubric_function_that_raises_makes_the_episode_unscorable_not_zero(chat, agent_server):
    env = VerifiersEnv("vf-judge-down")
    sample = await play(env, agent_server, chat, 0, ["2"])
    assert sample.process_rewards == [] and sample.unscorable is not None
    assert "reward function judge raised RuntimeError: the judge is down" in sample.unscorable


@pytest.mark.usefixtures("bad_environments")
async def test_a_blocking_rubric_function_runs_off_the_loop_and_its_episode_times_out(chat, agent_server):
    import asyncio
    import time

    env = VerifiersEnv("vf-slow-judge")
    row = env.rows()[0]
    prompt = Prompt(id=row.id, token_ids=[1], messages=row.messages, answer=row.answer, task=row.task,
                    metadata=row.metadata)
    episode = AgentEpisode(prompt, SPEC, ScriptedTurns(chat, ["2"]), chat, EpisodeLimits(max_tokens=512))
    gaps, stop = [], asyncio.Event()

    async def tick():
        while not stop.is_set():
            began = time.monotonic()
            await asyncio.sleep(0.05)
            gaps.append(time.monotonic() - began)

    ticker = asyncio.ensure_future(tick())
    began = time.monotonic()
    try:
        sample = await run_agent(env, episode, agent_server, group_id="g0", index=0, timeout_s=1.0)
    finally:
        stop.set()
        await ticker
        await env.aclose()
    assert time.monotonic() - began < 2.5
    assert sample.unscorable == "agent: timed out after 1 s (env.episode_timeout_s)"
    assert max(gaps) < 0.5, f"the event loop was blocked for {max(gaps):.2f} s"


@pytest.mark.usefixtures("bad_environments")
def test_an_environment_that_exits_or_returns_the_wrong_type_is_refused_naming_it():
    with pytest.raises(ConfigError, match=r"env.environment: loading 'vf-exits' called sys.exit\(0\)"):
        VerifiersEnv("vf-exits")
    with pytest.raises(ConfigError, match=r"'vf-not-an-env''s load_environment returned dict, not an Environment"):
        VerifiersEnv("vf-not-an-env")
