"""What a turn is on the agents' endpoint, in each dialect, with the official clients, the real
aiohttp server and the tiny model's real tokenizer (the model's turns scripted): a call past an
episode budget generates nothing and ends in the dialect's own stop reason, the episode's record
names the budget; a turn cut at a stop sequence keeps exactly the tokens up to it; a turn with a
broken tool call comes back as the text the model wrote."""

from __future__ import annotations

import anthropic
import msgspec
import openai
import pytest

from rollflow.agent import AgentEpisode, run_agent
from rollflow.batch import build_batch
from rollflow.envs import EpisodeLimits
from rollflow.records import Group, Message, Prompt, SamplingSpec
from rollflow.testing import ScriptedTurns

SPEC = SamplingSpec(temperature=1.0, max_tokens=64)
DIALECTS = ("chat", "responses", "anthropic")
CUT = {"chat": "length", "responses": "max_output_tokens", "anthropic": "max_tokens"}
"""Each dialect's way of saying the turn was cut at a budget."""


def episode(chat, turns, **limits) -> tuple[AgentEpisode, ScriptedTurns]:
    prompt = Prompt(id="p1", token_ids=[1], messages=[Message(role="user", content="hi")])
    script = ScriptedTurns(chat, turns)
    return AgentEpisode(prompt, SPEC, script, chat, EpisodeLimits(max_tokens=512, **limits)), script


async def ask(dialect: str, url: str, text: str) -> tuple[str, str]:
    """One call in `dialect` with its official client: (the reply's text, how the turn ended)."""
    if dialect == "anthropic":
        async with anthropic.AsyncAnthropic(base_url=url.removesuffix("/v1"), api_key="k", max_retries=0) as claude:
            reply = await claude.messages.create(model="tiny", max_tokens=64,
                                                 messages=[{"role": "user", "content": text}])
        return "".join(b.text for b in reply.content if b.type == "text"), reply.stop_reason
    async with openai.AsyncOpenAI(base_url=url, api_key="k", max_retries=0) as client:
        if dialect == "chat":
            chat = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": text}])
            return chat.choices[0].message.content or "", chat.choices[0].finish_reason
        response = await client.responses.create(model="tiny", input=text)
        ended = response.incomplete_details.reason if response.status == "incomplete" else response.status
        return response.output_text, ended


@pytest.mark.parametrize("dialect", DIALECTS)
async def test_a_call_past_the_turn_budget_generates_nothing_and_gets_the_dialects_stop_reason(
    chat, agent_server, dialect
):
    ep, script = episode(chat, ["first", "never"], max_turns=1)
    key, url = agent_server.open(ep)
    first = await ask(dialect, url, "go")
    second = await ask(dialect, url, "again")
    agent_server.close(key)
    assert first[0] == "first" and first[1] != CUT[dialect]
    assert second == ("", CUT[dialect]) and len(script.seen) == 1 and ep.budget == "turns"


@pytest.mark.parametrize("dialect", DIALECTS)
async def test_the_model_token_budget_spans_every_sequence_of_the_episode(chat, agent_server, dialect):
    """Each call sends a fresh history (a rewrite: a new sequence, which `max_tokens` bounds
    afresh); the model's tokens are counted over the whole episode, and the turn that reaches the
    budget is cut there, in the dialect's stop reason."""
    ep, script = episode(chat, ["one two", "three four five six seven eight nine", "never"], max_model_tokens=8)
    key, url = agent_server.open(ep)
    first = await ask(dialect, url, "go")
    assert first[1] != CUT[dialect] and ep.budget is None
    spent = ep.model_tokens
    second = await ask(dialect, url, "start over")
    third = await ask(dialect, url, "and again")
    agent_server.close(key)
    assert second[1] == CUT[dialect] and ep.model_tokens == 8 and spent < 8
    assert third == ("", CUT[dialect]) and len(script.seen) == 2
    sample = ep.sample("g", 0, reward=1.0, failure=None)
    assert sample.budget == "model_tokens" and len(sample.segments) == 1  # the third call began no sequence
    assert sum(s.loss_mask.count(1) for s in sample.segments) + sample.loss_mask.count(1) == 8


@pytest.mark.parametrize("dialect", DIALECTS)
async def test_a_call_after_the_time_budget_gets_the_stop_reason_and_the_agent_is_still_scored(
    chat, agent_server, dialect
):
    """Past `time_budget_s` the agent hears the budget's stop reason and finishes; its return value
    is the episode's reward (unlike `episode_timeout_s`, which ends it unscorable)."""
    replies = []

    async def agent(task, base_url):
        replies.append(await ask(dialect, base_url, "go"))
        ep.started -= 3600.0  # the episode has now run an hour: past its budget, with no waiting
        replies.append(await ask(dialect, base_url, "again"))
        return 0.5

    ep, script = episode(chat, ["in time", "never"], time_budget_s=60.0)
    sample = await run_agent(agent, ep, agent_server, group_id="g", index=0, timeout_s=30)
    assert replies == [("in time", replies[0][1]), ("", CUT[dialect])] and replies[0][1] != CUT[dialect]
    assert sample.unscorable is None and sample.process_rewards == [(sample.num_tokens - 1, 0.5)]
    assert sample.budget == "time" and len(script.seen) == 1


async def test_the_step_metrics_count_episodes_by_the_budget_that_ended_them(chat):
    ep, _ = episode(chat, ["a"])
    sample = ep.sample("g", 0, reward=1.0, failure=None)
    samples = [
        msgspec.structs.replace(sample, index=i, budget=budget, reward=reward, unscorable=why)
        for i, (budget, reward, why) in enumerate(
            [("turns", 1.0, None), ("turns", 0.0, None), ("time", None, "agent: raised"), (None, 0.5, None)]
        )
    ]
    group = Group(prompt=ep.prompt, samples=samples, advantages=[0.5, -0.5, 0.0, 0.0])
    _, stats = build_batch(0, [group], max_lag=1, max_tokens=512, reward_name="env")
    assert stats["budget_ends"] == {"turns": 2, "time": 1}


THOUGHT = "Thought: add them\nAction: calc\nObservation: 5, which the agent writes itself"


@pytest.mark.parametrize("dialect", ["chat", "anthropic"])
async def test_a_stop_sequence_cuts_the_turn_after_the_token_that_completes_it(chat, agent_server, dialect):
    """The turn stands up to the token whose text completes the stop sequence (every token
    before it exactly as sampled, with its log-prob); the reply's text ends before the sequence;
    sending the reply back with the tool's observation continues the same sequence."""
    ep, script = episode(chat, [THOUGHT, "Answer: 5"])
    key, url = agent_server.open(ep)
    history = [{"role": "user", "content": "What is 2 + 3?"}]
    if dialect == "chat":
        async with openai.AsyncOpenAI(base_url=url, api_key="k", max_retries=0) as client:
            one = await client.chat.completions.create(model="tiny", messages=history, stop=["Observation:", "Zzz"])
            text, ended = one.choices[0].message.content, one.choices[0].finish_reason
            history += [{"role": "assistant", "content": text}, {"role": "user", "content": "Observation: 5"}]
            await client.chat.completions.create(model="tiny", messages=history, stop=["Observation:"])
    else:
        async with anthropic.AsyncAnthropic(base_url=url.removesuffix("/v1"), api_key="k", max_retries=0) as claude:
            async with claude.messages.stream(model="tiny", max_tokens=64, messages=history,
                                              stop_sequences=["Zzz", "Observation:"]) as stream:
                one = await stream.get_final_message()
            text, ended = one.content[0].text, (one.stop_reason, one.stop_sequence)
            history += [{"role": "assistant", "content": text}, {"role": "user", "content": "Observation: 5"}]
            await claude.messages.create(model="tiny", max_tokens=64, messages=history, stop_sequences=["Observation:"])
    agent_server.close(key)
    assert text == "Thought: add them\nAction: calc\n"
    assert ended == ("stop" if dialect == "chat" else ("stop_sequence", "Observation:"))
    asked = ("Observation:", "Zzz") if dialect == "chat" else ("Zzz", "Observation:")
    assert [spec.stop for spec in script.specs] == [asked, ("Observation:",)]  # the engine stops there
    sample = ep.sample("g", 0, reward=1.0, failure=None)
    assert sample.segments == [] and sample.turns == 2 and ep.budget is None
    sampled = [*chat.tokens(THOUGHT), chat.tokenizer.eos_token_id]
    k = next(n for n in range(1, len(sampled)) if "Observation:" in chat.tokenizer.decode(sampled[:n]))
    assert sample.completion_token_ids[:k] == sampled[:k] and sample.logprobs[:k] == [-0.1 * i for i in range(k)]
    assert sample.loss_mask[:k] == [1] * k and sample.loss_mask[k] == 0  # the next token is the template's
    whole = sample.prompt_token_ids + sample.completion_token_ids
    assert script.seen[1] == whole[: len(script.seen[1])]  # the second turn continued the sequence
    between = chat.tokenizer.decode(script.seen[1][len(sample.prompt_token_ids) + k :])
    assert between.startswith("<|im_end|>") and "Observation: 5" in between


GOOD = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
BROKEN = '<tool_call>{"name"</tool_call>'


@pytest.mark.parametrize("dialect", DIALECTS)
async def test_a_turn_with_a_broken_tool_call_comes_back_as_the_text_the_model_wrote(chat, agent_server, dialect):
    """A well-formed call followed by a broken one: no call is run on the model's behalf, and the
    agent reads the whole turn as text (the broken block included) to answer it; the turn ends as
    an ordinary one."""
    ep, _ = episode(chat, [f"{GOOD} {BROKEN}"])
    key, url = agent_server.open(ep)
    text, ended = await ask(dialect, url, "What is 2 + 3?")
    agent_server.close(key)
    assert text == f"{GOOD} {BROKEN}" and ep.current.finish_reason == "stop"
    assert ended == {"chat": "stop", "responses": "completed", "anthropic": "end_turn"}[dialect]


async def test_a_client_that_disconnects_mid_stream_leaves_the_episode_whole(chat, agent_server):
    """The agent drops a streamed call while its turn is generating: the generation stops, nothing
    of that turn is recorded, and the agent's next call is served and recorded as the episode's
    only turn."""
    import asyncio

    import aiohttp

    stopped = asyncio.Event()
    script = ScriptedTurns(chat, ["after the drop"])

    async def generate(token_ids, spec, n):
        if not stopped.is_set():
            try:
                await asyncio.sleep(60)
            finally:
                stopped.set()
        return await script(token_ids, spec, n)

    prompt = Prompt(id="p1", token_ids=[1], messages=[Message(role="user", content="hi")])
    ep = AgentEpisode(prompt, SPEC, generate, chat, EpisodeLimits(max_tokens=512))

    async def agent(task, base_url):
        body = {"model": "tiny", "messages": task.messages, "stream": True}
        async with aiohttp.ClientSession() as session:
            dropped = asyncio.create_task(session.post(f"{base_url}/chat/completions", json=body))
            await asyncio.sleep(0.3)
            dropped.cancel()
        await asyncio.wait_for(stopped.wait(), 10)
        text, _ = await ask("chat", base_url, "hi")
        return 1.0 if text == "after the drop" else 0.0

    sample = await run_agent(agent, ep, agent_server, group_id="g", index=0, timeout_s=30)
    assert sample.unscorable is None and sample.process_rewards[-1][1] == 1.0
    assert sample.turns == 1 and chat.tokenizer.decode(sample.completion_token_ids, skip_special_tokens=True) == (
        "after the drop"
    )
    assert len(script.seen) == 1
