"""The agents' HTTP client (httpx's interface on aiohttp's pool): the real openai and anthropic
clients through it to the real endpoint, plain and streamed replies, and a connection refused as
the client's own connection error."""

from __future__ import annotations

import sys

import anthropic
import openai
import pytest

from rollflow.agent import AgentEpisode, AgentServer
from rollflow.agent.http import http_client
from rollflow.envs import EpisodeLimits
from rollflow.records import Message, Prompt, SamplingSpec
from rollflow.testing import ScriptedTurns, unused_port

SPEC = SamplingSpec(temperature=1.0, max_tokens=64)


async def test_replies_plain_and_streamed_come_through_the_aiohttp_pool(chat):
    server = AgentServer("tiny", SPEC)
    await server.start()
    http = http_client()
    try:
        prompt = Prompt(id="p", token_ids=[1], messages=[Message(role="user", content="hi")])
        episode = AgentEpisode(prompt, SPEC, ScriptedTurns(chat, ["hello there", "again"]), chat,
                               EpisodeLimits(max_tokens=256))
        key, url = server.open(episode)
        client = openai.AsyncOpenAI(base_url=url, api_key="unused", http_client=http, max_retries=0)
        messages = [{"role": "user", "content": "hi"}]
        reply = await client.chat.completions.create(model="tiny", messages=messages)
        assert reply.choices[0].message.content == "hello there" and reply.usage.completion_tokens > 0
        messages.append({"role": "assistant", "content": "hello there"})
        messages.append({"role": "user", "content": "more"})
        stream = await client.chat.completions.create(model="tiny", messages=messages, stream=True)
        text = "".join([chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices])
        assert text == "again"
        server.close(key)
    finally:
        await http.aclose()
        await server.aclose()


async def test_a_refused_connection_is_the_openai_clients_connection_error():
    http = http_client()
    try:
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{unused_port()}/v1", api_key="x",
                                    http_client=http, max_retries=0)
        with pytest.raises(openai.APIConnectionError):
            await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
    finally:
        await http.aclose()


async def test_the_anthropic_client_takes_it_too(chat):
    """The anthropic client refuses an HTTP client of another httpx than its own."""
    server = AgentServer("tiny", SPEC)
    await server.start()
    http = http_client(sdk="anthropic")
    try:
        prompt = Prompt(id="p", token_ids=[1], messages=[Message(role="user", content="hi")])
        episode = AgentEpisode(prompt, SPEC, ScriptedTurns(chat, ["hello there", "again"]), chat,
                               EpisodeLimits(max_tokens=256))
        key, _ = server.open(episode)
        claude = anthropic.AsyncAnthropic(base_url=server.url, api_key=server.api_key(key), http_client=http,
                                          max_retries=0)
        messages = [{"role": "user", "content": "hi"}]
        message = await claude.messages.create(model="tiny", messages=messages, max_tokens=64)
        assert message.content[0].text == "hello there" and message.usage.output_tokens > 0
        messages += [{"role": "assistant", "content": "hello there"}, {"role": "user", "content": "more"}]
        async with claude.messages.stream(model="tiny", messages=messages, max_tokens=64) as stream:
            assert "".join([text async for text in stream.text_stream]) == "again"
        server.close(key)
    finally:
        await http.aclose()
        await server.aclose()


async def test_a_refused_connection_is_the_anthropic_clients_connection_error():
    http = http_client(sdk="anthropic")
    try:
        claude = anthropic.AsyncAnthropic(base_url=f"http://127.0.0.1:{unused_port()}", api_key="x",
                                          http_client=http, max_retries=0)
        with pytest.raises(anthropic.APIConnectionError):
            await claude.messages.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8)
    finally:
        await http.aclose()


def test_an_unknown_client_library_is_an_error_naming_the_ones_it_knows():
    with pytest.raises(ValueError, match="sdk = 'requests', expected one of openai, anthropic"):
        http_client(sdk="requests")  # type: ignore[arg-type]


def test_a_client_library_that_is_not_installed_is_an_error_saying_so(monkeypatch):
    monkeypatch.setitem(sys.modules, "anthropic", None)  # what an environment without it imports
    with pytest.raises(ValueError, match="sdk = 'anthropic', but the anthropic package is not installed"):
        http_client(sdk="anthropic")
