"""Agents on the endpoint with real vLLM on the tiny model and the real `openai` and `anthropic`
clients (chat completions, Responses, Messages): what the client received is what was recorded,
token for token, with the version of the weights that computed it, across a weight update between
two calls; and a short training run of agents, some of which fail."""

from __future__ import annotations

import asyncio
import itertools

import openai
import pytest

import rollflow
from rollflow.agent import AgentEpisode, AgentServer, run_agent
from rollflow.controller.setup import Given
from rollflow.envs import ChatFormat, EpisodeLimits
from rollflow.models import load_tokenizer, tiny_model_path
from rollflow.records import Message, Prompt, SamplingSpec
from rollflow.rollout import Progress, rollout

pytestmark = pytest.mark.integration

GREEDY = SamplingSpec(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.mark.timeout(300)
async def test_what_the_client_received_is_recorded_with_exact_versions_across_an_update(
    engine_on_a, model_a, model_b
):
    engine = engine_on_a
    chat = ChatFormat(load_tokenizer(tiny_model_path(0)))
    server = AgentServer("tiny", GREEDY)
    await server.start()
    turns = []

    async def generate(token_ids, spec, n):
        sample = await rollout(engine, Prompt(id="ep", token_ids=token_ids), spec, group_id=f"ep/t{n}", index=0)
        turns.append((list(token_ids), sample))
        return sample

    replies = []

    async def agent(task, base_url):
        async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
            messages = list(task.messages)
            for turn in range(2):
                reply = await client.chat.completions.create(model=task.model, messages=messages, logprobs=True)
                replies.append(reply)
                messages += [reply.choices[0].message.model_dump(exclude_none=True),
                             {"role": "user", "content": "Check your answer."}]
                if turn == 0:
                    await engine.update_weights(model_b.state_dict())  # new weights between the calls
        return 1.0

    prompt = Prompt(id="ep", token_ids=[], messages=[Message(role="user", content="What is 2 + 3?")])
    version = engine.version
    try:
        episode = AgentEpisode(prompt, GREEDY, generate, chat, EpisodeLimits(max_turns=4, max_tokens=200))
        sample = await run_agent(agent, episode, server, group_id="ep", index=0, timeout_s=120)
    finally:
        await server.aclose()
    assert sample.unscorable is None and sample.turns == 2 and sample.segments == []
    (context0, turn0), (context1, turn1) = turns
    n0, n1 = turn0.num_tokens, turn1.num_tokens
    between = sample.completion_token_ids[n0 : len(sample.completion_token_ids) - n1]
    assert sample.completion_token_ids == turn0.completion_token_ids + between + turn1.completion_token_ids
    assert sample.loss_mask == [1] * n0 + [0] * len(between) + [1] * n1
    assert chat.tokenizer.decode(between).endswith(
        "<|im_start|>user\nCheck your answer.<|im_end|>\n<|im_start|>assistant\n"
    )
    assert context1 == sample.prompt_token_ids + sample.completion_token_ids[: n0 + len(between)]
    # What each call returned is exactly what was recorded: the log-probs, and the tokens' text.
    for reply, turn in zip(replies, (turn0, turn1), strict=True):
        returned = reply.choices[0].logprobs.content
        assert [t.logprob for t in returned] == turn.logprobs
        assert "".join(t.token for t in returned) == chat.tokenizer.decode(turn.completion_token_ids)
        assert reply.usage.completion_tokens == turn.num_tokens
    # Versions: the first call under the first weights, the second under those loaded between.
    assert sample.versions == [version] * (n0 + len(between)) + [version + 1] * n1
    assert turn0.completion_token_ids == model_a.greedy(context0, n0)[0]
    assert turn1.completion_token_ids == model_b.greedy(context1, n1)[0]


async def streamed_turn(dialect: str, task, base_url: str, history: list) -> tuple[str, int, str]:
    """One streamed call in `dialect` with the official client: (the text it assembled from the
    events, the output tokens it was told, how the turn ended); the reply is appended to `history`."""
    if dialect == "anthropic":
        import anthropic

        claude = anthropic.AsyncAnthropic(base_url=task.endpoint, api_key=task.api_key, max_retries=0)
        async with claude, claude.messages.stream(model=task.model, max_tokens=8, messages=history) as stream:
            reply = await stream.get_final_message()
        history.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]})
        text = "".join(b.text for b in reply.content if b.type == "text")
        return text, reply.usage.output_tokens, reply.stop_reason
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    async with client, client.responses.stream(model=task.model, input=history, store=False) as stream:
        # a turn cut at its budget ends with `response.incomplete`, as OpenAI's does (no final response)
        ends = [e.response async for e in stream if e.type in ("response.completed", "response.incomplete")]
    (response,) = ends
    history += [item.model_dump(exclude_none=True) for item in response.output]
    return response.output_text, response.usage.output_tokens, response.status


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("dialect", "cut"), [("anthropic", "max_tokens"), ("responses", "incomplete")])
async def test_a_streamed_call_in_each_dialect_is_recorded_with_exact_versions_across_an_update(
    engine_on_a, model_a, model_b, dialect, cut
):
    """The same with Anthropic's client and with the Responses API, streamed: the text each client
    assembled from the events is the recorded turn's text, and the usage its token count."""
    engine = engine_on_a
    chat = ChatFormat(load_tokenizer(tiny_model_path(0)))
    server = AgentServer("tiny", GREEDY)
    await server.start()
    turns, replies = [], []

    async def generate(token_ids, spec, n):
        sample = await rollout(engine, Prompt(id="ep", token_ids=token_ids), spec, group_id=f"ep/t{n}", index=0)
        turns.append((list(token_ids), sample))
        return sample

    async def agent(task, base_url):
        history = [{"role": "user", "content": task.prompt}]
        for turn in range(2):
            replies.append(await streamed_turn(dialect, task, base_url, history))
            history.append({"role": "user", "content": "Check your answer."})
            if turn == 0:
                await engine.update_weights(model_b.state_dict())
        return 1.0

    prompt = Prompt(id="ep", token_ids=[], messages=[Message(role="user", content="What is 2 + 3?")])
    version = engine.version
    try:
        episode = AgentEpisode(prompt, GREEDY, generate, chat, EpisodeLimits(max_turns=4, max_tokens=200))
        sample = await run_agent(agent, episode, server, group_id="ep", index=0, timeout_s=120)
    finally:
        await server.aclose()
    assert sample.unscorable is None and sample.turns == 2 and sample.segments == []
    (_, turn0), (context1, turn1) = turns
    n0, n1 = turn0.num_tokens, turn1.num_tokens
    between = sample.completion_token_ids[n0 : len(sample.completion_token_ids) - n1]
    assert sample.completion_token_ids == turn0.completion_token_ids + between + turn1.completion_token_ids
    assert context1 == sample.prompt_token_ids + sample.completion_token_ids[: n0 + len(between)]
    for (text, tokens, ended), turn in zip(replies, (turn0, turn1), strict=True):
        assert text == chat.tokenizer.decode(turn.completion_token_ids, skip_special_tokens=True)
        assert tokens == turn.num_tokens and ended == cut
    assert sample.versions == [version] * (n0 + len(between)) + [version + 1] * n1
    assert turn1.completion_token_ids == model_b.greedy(context1, n1)[0]


async def streamed_long_turn(dialect: str, task, base_url: str) -> tuple[str, list[float] | None, int, str]:
    """One streamed call of 160 tokens in `dialect` with the official client: (the text it
    assembled from the events, the log-probs they carried (None: the dialect has none), the output
    tokens it was told, how the turn ended)."""
    history = [{"role": "user", "content": task.prompt}]
    if dialect == "anthropic":
        import anthropic

        claude = anthropic.AsyncAnthropic(base_url=task.endpoint, api_key=task.api_key, max_retries=0)
        async with claude, claude.messages.stream(model=task.model, max_tokens=160, messages=history) as stream:
            reply = await stream.get_final_message()
        return "".join(b.text for b in reply.content if b.type == "text"), None, reply.usage.output_tokens, \
            reply.stop_reason
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    text, logprobs, tokens, ended = "", [], 0, ""
    async with client:
        if dialect == "chat":
            stream = await client.chat.completions.create(model=task.model, messages=history, stream=True,
                                                          logprobs=True, stream_options={"include_usage": True})
            async for chunk in stream:
                if chunk.usage:
                    tokens = chunk.usage.completion_tokens
                for choice in chunk.choices:
                    text += choice.delta.content or ""
                    logprobs += [t.logprob for t in (choice.logprobs.content if choice.logprobs else None) or []]
                    ended = choice.finish_reason or ended
            return text, logprobs, tokens, ended
        async with client.responses.stream(model=task.model, input=history, store=False,
                                           include=["message.output_text.logprobs"]) as events:
            async for event in events:
                if event.type == "response.output_text.delta":
                    text += event.delta
                    logprobs += [t.logprob for t in event.logprobs]
                elif event.type in ("response.completed", "response.incomplete"):
                    done = event.response
    return text, logprobs, done.usage.output_tokens, done.status


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("dialect", "cut"), [("chat", "length"), ("responses", "incomplete"),
                                              ("anthropic", "max_tokens")])
async def test_an_update_in_the_middle_of_a_streamed_turn_is_recorded_exactly_in_each_dialect(
    engine_on_a, model_a, model_b, dialect, cut
):
    """New weights land while a streamed turn is being generated (after its fourth token): the
    turn is model A's greedy tokens up to the update and model B's from that prefix on, each
    labelled with the version that computed it, and what the client assembled from the stream (its
    text, its log-probs where the dialect has them, its token count) is exactly what was recorded."""
    engine = engine_on_a
    chat = ChatFormat(load_tokenizer(tiny_model_path(0)))
    spec = SamplingSpec(temperature=0.0, max_tokens=160, ignore_eos=True)
    server = AgentServer("tiny", spec)
    await server.start()
    turns, received = [], []

    async def generate(token_ids, spec, n):
        progress = Progress()
        prompt = Prompt(id="ep", token_ids=token_ids)
        running = asyncio.create_task(rollout(engine, prompt, spec, group_id=f"ep/t{n}", index=0, progress=progress))
        while len(progress.snapshot(engine).tokens) < 4:  # tokens, not time: mid-turn on any machine
            assert not running.done(), "the turn finished before the update; make it longer"
            await asyncio.sleep(0.002)
        await engine.update_weights(model_b.state_dict())
        sample = await running
        turns.append((list(token_ids), sample))
        return sample

    async def agent(task, base_url):
        received.append(await streamed_long_turn(dialect, task, base_url))
        return 1.0

    prompt = Prompt(id="ep", token_ids=[], messages=[Message(role="user", content="Count to twenty.")])
    v = engine.version
    try:
        episode = AgentEpisode(prompt, spec, generate, chat, EpisodeLimits(max_turns=1, max_tokens=400))
        sample = await run_agent(agent, episode, server, group_id="ep", index=0, timeout_s=120)
    finally:
        await server.aclose()
    assert sample.unscorable is None and sample.turns == 1
    ((context, turn),) = turns
    (text, logprobs, count, ended) = received[0]
    n = turn.num_tokens
    assert sample.completion_token_ids == turn.completion_token_ids and sample.logprobs == turn.logprobs
    k = sample.versions.index(v + 1)
    assert 0 < k < n and sample.versions == [v] * k + [v + 1] * (n - k)
    tokens = sample.completion_token_ids
    assert tokens[:k] == model_a.greedy(context, k)[0]
    assert tokens[k:] == model_b.greedy(context + tokens[:k], n - k)[0]
    assert text == chat.tokenizer.decode(tokens, skip_special_tokens=True) and count == n and ended == cut
    if logprobs is not None:
        assert logprobs == sample.logprobs


@pytest.mark.timeout(600)
async def test_a_short_run_of_openai_agents_some_of_which_fail(tmp_path, tiny_preset_engine):
    calls = itertools.count()

    async def agent(task, base_url):
        n = next(calls)
        async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
            messages = list(task.messages)
            reply = await client.chat.completions.create(model=task.model, messages=messages, max_tokens=8)
            if n % 5 == 4:
                raise RuntimeError("the agent's parser failed")
            messages += [reply.choices[0].message.model_dump(exclude_none=True),
                         {"role": "user", "content": "Once more, shorter."}]
            reply = await client.chat.completions.create(model=task.model, messages=messages, max_tokens=8)
        return float(len(reply.choices[0].message.content or "") % 3)

    config = rollflow.load_config(preset="tiny", overrides=["run.max_steps=2", "env.kind=agent", "env.max_tokens=96",
                                                            "observe.sinks=[]"])
    result = await rollflow.Controller(
        config,
        tmp_path,
        agent=agent,
        given=Given(engine=await tiny_preset_engine()),
    ).run()
    assert result.steps == 2 and rollflow.audit_ledger(tmp_path).ok
    assert all(set(m["rewards"]) == {"env"} and m["agent_splits"] == 0 for m in result.metrics)
    assert all(m["turns_mean"] == 2.0 for m in result.metrics)  # the failed episodes are not in the batch
    failed = sum(m["unscorable_by_reason"].get("agent: raised RuntimeError: the agent's parser failed", 0)
                 for m in result.metrics)
    assert failed > 0
