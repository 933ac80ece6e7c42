"""OpenAI's Responses API on the agents' endpoint, with the official `openai` client, the real
aiohttp server and the tiny model's real tokenizer; only the model's turns are scripted, so every
recorded token can be checked against what the engine produced."""

from __future__ import annotations

import json

import openai
import pytest

from rollflow.agent import AgentEpisode, run_agent
from rollflow.envs import EpisodeLimits
from rollflow.records import Message, Prompt, SamplingSpec
from rollflow.testing import ScriptedTurns

SPEC = SamplingSpec(temperature=1.0, max_tokens=64)
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "2 + 3"}}</tool_call>'
TOOLS = [{"type": "function", "name": "calculator", "description": "Evaluate an arithmetic expression.",
          "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}]


def episode(chat, turns) -> tuple[AgentEpisode, ScriptedTurns]:
    prompt = Prompt(id="p1", token_ids=[1], messages=[Message(role="user", content="What is 2 + 3?")], answer="5")
    script = ScriptedTurns(chat, turns)
    return AgentEpisode(prompt, SPEC, script, chat, EpisodeLimits(max_tokens=512)), script


def tool_outputs(reply) -> list[dict]:
    return [{"type": "function_call_output", "call_id": item.call_id,
             "output": str(eval(json.loads(item.arguments)["expression"]))}
            for item in reply.output if item.type == "function_call"]


async def chained_agent(task, base_url):
    """A Responses tool loop that keeps state on the server: `previous_response_id`."""
    async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
        reply = await client.responses.create(model=task.model, instructions="Use the calculator.",
                                              input=task.prompt, tools=TOOLS)
        for _ in range(3):
            outputs = tool_outputs(reply)
            if not outputs:
                return 1.0 if reply.output_text.strip() == task.answer else 0.0
            reply = await client.responses.create(model=task.model, instructions="Use the calculator.",
                                                  previous_response_id=reply.id, input=outputs, tools=TOOLS)
    return 0.0


async def stateless_agent(task, base_url):
    """The same loop sending the whole history each time (`store=False` style)."""
    history = [{"role": "user", "content": task.prompt}]
    async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
        for _ in range(3):
            reply = await client.responses.create(model=task.model, instructions="Use the calculator.",
                                                  input=history, tools=TOOLS, store=False)
            history += [item.model_dump(exclude_none=True) for item in reply.output]
            outputs = tool_outputs(reply)
            if not outputs:
                return 1.0 if reply.output_text.strip() == task.answer else 0.0
            history += outputs
    return 0.0


@pytest.mark.parametrize("agent", [chained_agent, stateless_agent])
async def test_a_tool_loop_is_recorded_as_one_sequence_with_exactly_the_sampled_tokens(chat, agent_server, agent):
    ep, script = episode(chat, [CALL, "5"])
    sample = await run_agent(agent, ep, agent_server, group_id="g0", index=0, timeout_s=30)
    assert sample.unscorable is None and sample.process_rewards == [(sample.num_tokens - 1, 1.0)]
    assert sample.turns == 2 and sample.segments == []  # both ways of continuing extend the sequence
    eos = chat.tokenizer.eos_token_id
    first, second = [*chat.tokens(CALL), eos], [*chat.tokens("5"), eos]
    tool = sample.completion_token_ids[len(first) : len(sample.completion_token_ids) - len(second)]
    assert sample.completion_token_ids == first + tool + second
    assert sample.loss_mask == [1] * len(first) + [0] * len(tool) + [1] * len(second)
    assert "5" in chat.tokenizer.decode(tool)
    assert script.seen[1] == sample.prompt_token_ids + first + tool
    opening = [Message(role="system", content="Use the calculator."), Message(role="user", content="What is 2 + 3?")]
    functions = [{"type": "function", "function": {"name": "calculator", "parameters": TOOLS[0]["parameters"],
                                                   "description": TOOLS[0]["description"]}}]
    assert sample.prompt_token_ids == chat.tokens(chat.render(opening, functions))


@pytest.mark.parametrize("stream", [False, True])
async def test_the_client_reads_text_function_calls_status_and_usage(chat, agent_server, stream):
    ep, _ = episode(chat, ["Let me compute. " + CALL])
    key, url = agent_server.open(ep)
    request = {"model": "tiny", "input": "What is 2 + 3?", "tools": TOOLS}
    async with openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0) as client:
        if stream:
            async with client.responses.stream(**request) as events:
                kinds = [event.type async for event in events]
                reply = await events.get_final_response()
            assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
            assert "response.output_text.delta" in kinds and "response.function_call_arguments.done" in kinds
        else:
            reply = await client.responses.create(**request)
    agent_server.close(key)
    message, call = reply.output
    assert message.type == "message" and reply.output_text == "Let me compute."
    assert call.type == "function_call" and call.name == "calculator"
    assert json.loads(call.arguments) == {"expression": "2 + 3"}
    assert reply.status == "completed" and reply.model == "tiny"
    assert reply.usage.output_tokens == len(ep.current.tokens)
    assert reply.usage.input_tokens == len(ep.current.opening)


async def test_a_turn_past_the_budget_is_incomplete_and_a_foreign_previous_response_is_refused(chat, agent_server):
    prompt = Prompt(id="p1", token_ids=[1], messages=[Message(role="user", content="hi")])
    ep = AgentEpisode(prompt, SPEC, ScriptedTurns(chat, ["one turn"]), chat, EpisodeLimits(max_turns=1))
    other, _ = episode(chat, ["other"])
    _, url = agent_server.open(ep)
    _, other_url = agent_server.open(other)
    async with openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0) as client:
        first = await client.responses.create(model="tiny", input="hi")
        cut = await client.responses.create(model="tiny", input="go on", previous_response_id=first.id)
    assert first.status == "completed" and first.output_text == "one turn"
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens" and cut.output == []
    async with openai.AsyncOpenAI(base_url=other_url, api_key="unused", max_retries=0) as client:
        with pytest.raises(openai.BadRequestError) as err:
            await client.responses.create(model="tiny", input="go on", previous_response_id=first.id)
    assert err.value.body["param"] == "previous_response_id" and "in this episode" in err.value.body["message"]
    assert other.calls == 0


async def test_a_history_that_does_not_extend_the_episode_starts_a_new_segment(chat, agent_server):
    ep, _ = episode(chat, ["first answer", "second answer"])
    key, url = agent_server.open(ep)
    async with openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0) as client:
        await client.responses.create(model="tiny", input="hi")
        await client.responses.create(model="tiny", input=[
            {"role": "user", "content": "hi"}, {"role": "assistant", "content": "a summary of it"},
            {"role": "user", "content": "go on"}])
    agent_server.close(key)
    assert ep.splits == 1 and ep.calls == 2


@pytest.mark.parametrize(("change", "param", "words"), [
    ({"temperature": 0.2}, "temperature", "this run samples with temperature = 1.0"),
    ({"tool_choice": "required", "tools": TOOLS}, "tool_choice", "constrained decoding"),
    ({"tools": [{"type": "web_search"}]}, "tools[0]", "only function tools"),
    ({"text": {"format": {"type": "json_object"}}}, "text", "structured output"),
    ({"reasoning": {"effort": "high"}}, "reasoning", "reasoning settings are not supported"),
    ({"model": "gpt-5"}, "model", "serves the model 'tiny', not 'gpt-5'"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content",
     "images and files are not supported"),
    ({"extra_body": {"frequency_penalty": 1}}, "frequency_penalty", "unknown field"),
])
async def test_requests_the_run_cannot_honour_get_an_openai_error_naming_the_field(
        chat, agent_server, change, param, words):
    ep, _ = episode(chat, ["never"])
    _, url = agent_server.open(ep)
    request = {"model": "tiny", "input": "hi"} | change
    async with openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0) as client:
        with pytest.raises(openai.BadRequestError) as err:
            await client.responses.create(**request)
    assert err.value.body["param"] == param and words in err.value.body["message"]
    assert ep.calls == 0


async def test_the_runs_one_url_serves_responses_by_the_episodes_key(chat, agent_server):
    ep, _ = episode(chat, ["by key"])
    key, _ = agent_server.open(ep)
    async with openai.AsyncOpenAI(base_url=f"{agent_server.url}/v1", api_key=agent_server.api_key(key),
                                  max_retries=0) as client:
        reply = await client.responses.create(model="tiny", input="hi")
    assert reply.output_text == "by key" and ep.calls == 1


@pytest.mark.parametrize("stream", [False, True])
async def test_include_logprobs_gives_every_token_of_the_turn_as_recorded(chat, agent_server, stream):
    ep, _ = episode(chat, ["The answer is 5."])
    key, url = agent_server.open(ep)
    request = {"model": "tiny", "input": "What is 2 + 3?", "include": ["message.output_text.logprobs"]}
    async with openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0) as client:
        if stream:
            async with client.responses.stream(**request) as events:
                deltas = [e.logprobs async for e in events if e.type == "response.output_text.delta"]
                reply = await events.get_final_response()
            assert [t.logprob for t in deltas[0]] == ep.current.logprobs
        else:
            reply = await client.responses.create(**request)
    agent_server.close(key)
    returned = reply.output[0].content[0].logprobs
    assert [t.logprob for t in returned] == ep.current.logprobs == [-0.1 * i for i in range(len(ep.current.tokens))]
    assert "".join(t.token for t in returned) == chat.tokenizer.decode(ep.current.tokens)
