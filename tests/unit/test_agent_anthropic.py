"""Anthropic's Messages API on the agents' endpoint, with the official `anthropic` client, the real
aiohttp server and the tiny model's real tokenizer; only the model's turns are scripted, so every
recorded token can be checked against what the engine produced."""

from __future__ import annotations

import asyncio

import anthropic
import openai
import pytest

from rollflow.agent import AgentEpisode, run_agent
from rollflow.envs import EpisodeLimits
from rollflow.records import Message, Prompt, SamplingSpec
from rollflow.testing import ScriptedTurns

SPEC = SamplingSpec(temperature=1.0, max_tokens=64)
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "2 + 3"}}</tool_call>'
TOOLS = [{"name": "calculator", "description": "Evaluate an arithmetic expression.",
          "input_schema": {"type": "object", "properties": {"expression": {"type": "string"}}}}]


def episode(chat, turns) -> tuple[AgentEpisode, ScriptedTurns]:
    prompt = Prompt(id="p1", token_ids=[1], messages=[Message(role="user", content="What is 2 + 3?")], answer="5")
    script = ScriptedTurns(chat, turns)
    return AgentEpisode(prompt, SPEC, script, chat, EpisodeLimits(max_tokens=512)), script


def client_for(base_url: str) -> anthropic.AsyncAnthropic:
    """Anthropic's client on the episode: its base URL is the episode's without `/v1`."""
    return anthropic.AsyncAnthropic(base_url=base_url.removesuffix("/v1"), api_key="unused", max_retries=0)


async def claude_style_agent(task, base_url):
    """An ordinary Messages API tool loop: call, run the tool_use blocks, send tool_result blocks."""
    messages = [{"role": "user", "content": task.prompt}]
    async with client_for(base_url) as client:
        for _ in range(4):
            reply = await client.messages.create(model=task.model, max_tokens=64, system="Use the calculator.",
                                                 messages=messages, tools=TOOLS)
            messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]})
            uses = [b for b in reply.content if b.type == "tool_use"]
            if reply.stop_reason != "tool_use":
                text = "".join(b.text for b in reply.content if b.type == "text")
                return 1.0 if text.strip() == task.answer else 0.0
            messages.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": u.id, "content": str(eval(u.input["expression"]))}
                for u in uses]})
    return 0.0


async def test_a_tool_loop_is_recorded_as_one_sequence_with_exactly_the_sampled_tokens(chat, agent_server):
    ep, script = episode(chat, [CALL, "5"])
    sample = await run_agent(claude_style_agent, ep, agent_server, group_id="g0", index=0, timeout_s=30)
    assert sample.unscorable is None and sample.process_rewards == [(sample.num_tokens - 1, 1.0)]
    assert sample.turns == 2 and sample.segments == []  # the history came back as it was returned
    eos = chat.tokenizer.eos_token_id
    first, second = [*chat.tokens(CALL), eos], [*chat.tokens("5"), eos]
    tool = sample.completion_token_ids[len(first) : len(sample.completion_token_ids) - len(second)]
    assert sample.completion_token_ids == first + tool + second
    assert sample.loss_mask == [1] * len(first) + [0] * len(tool) + [1] * len(second)
    assert "5" in chat.tokenizer.decode(tool)
    assert sample.logprobs[: len(first)] == [-0.1 * i for i in range(len(first))]
    assert script.seen[1] == sample.prompt_token_ids + first + tool
    opening = [Message(role="system", content="Use the calculator."), Message(role="user", content="What is 2 + 3?")]
    functions = [{"type": "function", "function": {"name": "calculator", "parameters": TOOLS[0]["input_schema"],
                                                   "description": TOOLS[0]["description"]}}]
    assert sample.prompt_token_ids == chat.tokens(chat.render(opening, functions))


@pytest.mark.parametrize("stream", [False, True])
async def test_the_client_reads_text_tool_use_stop_reason_and_usage(chat, agent_server, stream):
    ep, _ = episode(chat, ["Let me compute. " + CALL])
    key, url = agent_server.open(ep)
    request = {"model": "tiny", "max_tokens": 64, "messages": [{"role": "user", "content": "What is 2 + 3?"}],
               "tools": TOOLS}
    async with client_for(url) as client:
        if stream:
            async with client.messages.stream(**request) as events:
                kinds = [event.type async for event in events]
                reply = await events.get_final_message()
            assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
        else:
            reply = await client.messages.create(**request)
    agent_server.close(key)
    text, use = reply.content
    assert text.type == "text" and text.text == "Let me compute."
    assert use.type == "tool_use" and use.name == "calculator" and use.input == {"expression": "2 + 3"}
    assert reply.stop_reason == "tool_use" and reply.model == "tiny"
    assert reply.usage.output_tokens == len(ep.current.tokens)
    assert reply.usage.input_tokens == len(ep.current.opening)


async def test_a_history_that_does_not_extend_the_episode_starts_a_new_segment(chat, agent_server):
    ep, _ = episode(chat, ["first answer", "second answer"])
    key, url = agent_server.open(ep)
    async with client_for(url) as client:
        await client.messages.create(model="tiny", max_tokens=64, messages=[{"role": "user", "content": "hi"}])
        await client.messages.create(model="tiny", max_tokens=64, messages=[
            {"role": "user", "content": "hi"}, {"role": "assistant", "content": "a summary of it"},
            {"role": "user", "content": "go on"}])
    agent_server.close(key)
    assert ep.splits == 1 and ep.calls == 2


@pytest.mark.parametrize(("change", "words"), [
    ({"extra_body": {"temperature": 0.2}}, "temperature: this run samples with temperature = 1.0"),
    ({"extra_body": {"top_k": 5}}, "top_k would change the distribution"),
    ({"stop_sequences": ["\n", 5]}, "stop_sequences: expected a non-empty string or a list of them"),
    ({"tool_choice": {"type": "any"}, "tools": TOOLS}, "a forced call would need constrained decoding"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "extended thinking is not supported"),
    ({"model": "claude-opus"}, "serves the model 'tiny', not 'claude-opus'"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "only custom tools"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "x"}}]}]},
     "a user turn holds text and tool_result blocks, not 'image'"),
    ({"extra_body": {"top_logprobs": 3}}, "unknown field 'top_logprobs'"),
])
async def test_requests_the_run_cannot_honour_get_anthropic_errors_naming_the_field(chat, agent_server, change, words):
    ep, _ = episode(chat, ["never"])
    _, url = agent_server.open(ep)
    request = {"model": "tiny", "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}]} | change
    async with client_for(url) as client:
        with pytest.raises(anthropic.BadRequestError) as err:
            await client.messages.create(**request)
    assert err.value.status_code == 400 and err.value.body["error"]["type"] == "invalid_request_error"
    assert words in err.value.body["error"]["message"]
    assert ep.calls == 0  # nothing was generated


async def test_an_ended_episode_is_a_not_found_error_and_both_clients_list_the_model(chat, agent_server):
    ep, _ = episode(chat, ["hello"])
    key, url = agent_server.open(ep)
    async with client_for(url) as client:
        models = await client.models.list()
        assert [m.id for m in models.data] == ["tiny"]
        agent_server.close(key)
        with pytest.raises(anthropic.NotFoundError) as err:
            await client.messages.create(model="tiny", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    assert err.value.body["error"]["type"] == "not_found_error"
    async with openai.AsyncOpenAI(base_url=url, api_key="unused") as client:
        assert [m.id async for m in client.models.list()] == ["tiny"]


# ---- one URL per run: the episode chosen by the call's key ----------------------------------------


async def test_the_runs_one_url_serves_each_episode_by_its_key_in_both_dialects(chat, agent_server):
    first, _ = episode(chat, ["from openai"])
    second, _ = episode(chat, ["from anthropic"])
    one, _ = agent_server.open(first)
    two, _ = agent_server.open(second)
    key_one, key_two = agent_server.api_key(one), agent_server.api_key(two)
    assert key_one != key_two and len(key_one) >= 32
    async with openai.AsyncOpenAI(base_url=f"{agent_server.url}/v1", api_key=key_one) as client:
        reply = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
    assert reply.choices[0].message.content == "from openai"
    async with anthropic.AsyncAnthropic(base_url=agent_server.url, api_key=key_two, max_retries=0) as client:
        message = await client.messages.create(model="tiny", max_tokens=16,
                                               messages=[{"role": "user", "content": "hi"}])
    assert message.content[0].text == "from anthropic"
    assert (first.calls, second.calls) == (1, 1)  # each call went to its own episode


async def test_a_wrong_missing_or_expired_key_is_a_401_and_never_another_episodes_context(chat, agent_server):
    live, _ = episode(chat, ["live", "live again"])
    ended, _ = episode(chat, ["never"])
    live_id, _ = agent_server.open(live)
    ended_id, _ = agent_server.open(ended)
    expired = agent_server.api_key(ended_id)
    agent_server.close(ended_id)
    for key in ("not-a-key", expired):
        async with openai.AsyncOpenAI(base_url=f"{agent_server.url}/v1", api_key=key, max_retries=0) as client:
            with pytest.raises(openai.AuthenticationError) as err:
                await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
        assert err.value.body["code"] == "invalid_api_key"
        async with anthropic.AsyncAnthropic(base_url=agent_server.url, api_key=key, max_retries=0) as client:
            with pytest.raises(anthropic.AuthenticationError) as err:
                await client.messages.create(model="tiny", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
        assert err.value.body["error"]["type"] == "authentication_error"
    import aiohttp

    url = f"{agent_server.url}/v1/chat/completions"
    async with aiohttp.ClientSession() as http, http.post(url, json={"model": "tiny"}) as response:
        assert response.status == 401 and "no API key" in (await response.json())["error"]["message"]
    assert live.calls == 0 and ended.calls == 0
    assert agent_server.api_key(live_id)  # the live episode keeps its key


async def test_a_program_that_reads_its_base_url_and_key_from_the_environment_runs_unchanged(chat, agent_server):
    """An agent that is a separate program, configured only by OPENAI_BASE_URL / ANTHROPIC_BASE_URL
    and their keys (`AgentTask.environ`), as Claude Code, Codex and most CLIs are."""
    import os
    import sys

    program = (
        "import anthropic, openai\n"
        "a = openai.OpenAI().chat.completions.create(model='tiny', messages=[{'role': 'user', 'content': 'hi'}])\n"
        "b = anthropic.Anthropic().messages.create(model='tiny', max_tokens=16, messages=["
        "{'role': 'user', 'content': 'hi'}, {'role': 'assistant', 'content': a.choices[0].message.content},"
        "{'role': 'user', 'content': 'and?'}])\n"
        "print(b.content[0].text)\n"
    )

    async def cli_agent(task, base_url):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "ANTHROPIC_"))} | task.environ
        proc = await asyncio.create_subprocess_exec(sys.executable, "-c", program, env=env,
                                                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await proc.communicate()
        assert proc.returncode == 0, err.decode()[-500:]
        return 1.0 if out.decode().strip() == "second" else 0.0

    ep, _ = episode(chat, ["first", "second"])
    sample = await run_agent(cli_agent, ep, agent_server, group_id="g0", index=0, timeout_s=60)
    assert sample.unscorable is None and sample.process_rewards[-1][1] == 1.0
    assert sample.turns == 2 and sample.segments == []  # the second dialect continued the first's sequence
