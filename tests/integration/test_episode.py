"""A multi-turn tool episode with real vLLM on the tiny model: the token layout, the loss mask,
per-token versions across a weight update between turns, and a tool that hangs."""

from __future__ import annotations

import time

import pytest

import rollflow
from rollflow.controller.setup import Given
from rollflow.envs import ChatFormat, EnvStep, EpisodeLimits, run_episode
from rollflow.envs.tools import ToolCall, call_tool
from rollflow.models import load_tokenizer, tiny_model_path
from rollflow.records import Message, Prompt, SamplingSpec
from rollflow.rollout import rollout

pytestmark = pytest.mark.integration

TURN = SamplingSpec(temperature=0.0, max_tokens=8, ignore_eos=True)
TOOL_TIMEOUT_S = 0.3


class ToolThenUpdate:
    """Whatever the (random) model says first is taken as a call of a tool that hangs; before
    answering, the environment has the engine load other weights. The second turn ends it."""

    def __init__(self, engine, weights) -> None:
        self.engine, self.weights = engine, weights
        self.observations: list[str] = []

    async def reset(self, prompt: Prompt) -> list[Message]:
        return list(prompt.messages)

    async def step(self, turn):
        if turn.index == 1:
            return EnvStep(reward=0.0, done=True)

        def hangs(expression: str) -> str:
            time.sleep(3)
            return "too late"

        result = await call_tool({"calculator": hangs}, ToolCall("calculator", {"expression": "1+1"}), TOOL_TIMEOUT_S)
        self.observations.append(result)
        await self.engine.update_weights(self.weights)  # between the turns
        return EnvStep(messages=[Message(role="tool", content=result)])


@pytest.mark.timeout(300)
async def test_tool_episode_masks_versions_and_tool_timeout(engine_on_a, model_a, model_b):
    engine = engine_on_a
    chat = ChatFormat(load_tokenizer(tiny_model_path(0)))
    env = ToolThenUpdate(engine, model_b.state_dict())
    turns = []

    async def generate(token_ids, spec, n):
        sample = await rollout(engine, Prompt(id="ep", token_ids=token_ids), spec, group_id=f"ep/t{n}", index=0)
        turns.append((list(token_ids), sample))
        return sample

    prompt = Prompt(id="ep", token_ids=[], messages=[Message(role="user", content="What is 2 + 3?")])
    version = engine.version
    began = time.monotonic()
    sample = await run_episode(
        env, prompt, TURN, generate, chat, group_id="ep", index=0, limits=EpisodeLimits(max_turns=4, max_tokens=200)
    )
    assert time.monotonic() - began < 30
    assert env.observations == [f"error: tool calculator timed out after {TOOL_TIMEOUT_S:g} s"]
    (context0, turn0), (context1, turn1) = turns
    n0, n1 = turn0.num_tokens, turn1.num_tokens
    env_tokens = sample.completion_token_ids[n0 : len(sample.completion_token_ids) - n1]
    # Layout: turn 0 as sampled, the tool result rendered by the template, turn 1 as sampled.
    assert n0 == n1 == TURN.max_tokens and sample.turns == 2
    assert sample.completion_token_ids == turn0.completion_token_ids + env_tokens + turn1.completion_token_ids
    assert chat.tokenizer.decode(env_tokens, skip_special_tokens=False).endswith(
        f"<|im_start|>tool\n{env.observations[0]}<|im_end|>\n<|im_start|>assistant\n"
    )
    assert sample.loss_mask == [1] * n0 + [0] * len(env_tokens) + [1] * n1
    assert context1 == sample.prompt_token_ids + sample.completion_token_ids[: n0 + len(env_tokens)]
    # Versions: turn 0 under the first weights, turn 1 under the weights loaded between the turns.
    assert sample.versions == [version] * (n0 + len(env_tokens)) + [version + 1] * n1
    # And those really are the weights that computed each turn (greedy, float32).
    want0, logp0 = model_a.greedy(context0, n0)
    want1, logp1 = model_b.greedy(context1, n1)
    assert turn0.completion_token_ids == want0 and turn1.completion_token_ids == want1
    assert sample.logprobs[:n0] == pytest.approx(logp0, abs=1e-4)
    assert sample.logprobs[-n1:] == pytest.approx(logp1, abs=1e-4)


@pytest.mark.timeout(600)
async def test_a_short_run_with_the_calculator_environment(tmp_path, tiny_preset_engine):
    config = rollflow.load_config(
        preset="tiny",
        overrides=[
            "env.kind=tool",
            "env.name=calculator",
            "env.max_turns=2",
            "env.max_tokens=64",
            "run.max_steps=2",
            "observe.sinks=[]",
        ],
    )
    result = await rollflow.Controller(config, tmp_path, given=Given(engine=await tiny_preset_engine())).run()
    assert result.steps == 2 and all(set(m["rewards"]) == {"env"} for m in result.metrics)
    assert all(m["unscorable"] == 0 and m["turns_mean"] >= 1 for m in result.metrics)
    assert rollflow.audit_ledger(tmp_path).ok
