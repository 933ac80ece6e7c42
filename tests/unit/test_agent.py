"""The agents' OpenAI-compatible endpoint and its recording, with scripted model turns: the real
aiohttp server, the real `openai` client and the tiny model's real tokenizer; only the model's
turns are scripted, so every recorded token can be checked. Real vLLM is in
tests/integration/test_agent_vllm.py."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import openai
import pytest

from rollflow.agent import AgentEpisode, run_agent
from rollflow.batch import build_batch
from rollflow.controller.setup import Given
from rollflow.envs import EpisodeLimits
from rollflow.models import load_tokenizer, tiny_model_path
from rollflow.records import Group, Message, Prompt, SamplingSpec
from rollflow.testing import ScriptedTurns

SPEC = SamplingSpec(temperature=1.0, max_tokens=64)
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "2 + 3"}}</tool_call>'


def episode(chat, turns, **limits) -> tuple[AgentEpisode, ScriptedTurns]:
    prompt = Prompt(id="p1", token_ids=[1], messages=[Message(role="user", content="What is 2 + 3?")], answer="5")
    script = ScriptedTurns(chat, turns)
    return AgentEpisode(prompt, SPEC, script, chat, EpisodeLimits(**({"max_tokens": 512} | limits))), script


async def calculator_agent(task, base_url):
    """An ordinary OpenAI tool loop: call the model, run its tool calls, call again."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused")
    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]
    messages = list(task.messages)
    async with client:
        for _ in range(4):
            reply = await client.chat.completions.create(model=task.model, messages=messages, tools=tools,
                                                         logprobs=True)
            message = reply.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                return 1.0 if (message.content or "").strip() == task.answer else 0.0
            for call in message.tool_calls:
                expression = json.loads(call.function.arguments)["expression"]
                messages.append({"role": "tool", "tool_call_id": call.id, "content": str(eval(expression))})
    return 0.0


async def test_a_tool_loop_is_recorded_as_one_sequence_with_exactly_the_sampled_tokens(chat, agent_server):
    ep, script = episode(chat, [CALL, "5"])
    sample = await run_agent(calculator_agent, ep, agent_server, group_id="g0", index=0, timeout_s=30)
    assert sample.unscorable is None and sample.process_rewards == [(sample.num_tokens - 1, 1.0)]
    assert sample.turns == 2 and sample.segments == []
    eos = chat.tokenizer.eos_token_id
    first, second = [*chat.tokens(CALL), eos], [*chat.tokens("5"), eos]
    # model tokens as sampled, then the tool result rendered by the template, then the answer
    tool = sample.completion_token_ids[len(first) : len(sample.completion_token_ids) - len(second)]
    assert sample.completion_token_ids == first + tool + second
    assert sample.loss_mask == [1] * len(first) + [0] * len(tool) + [1] * len(second)
    assert "5" in chat.tokenizer.decode(tool) and "tool" in chat.tokenizer.decode(tool)
    assert sample.logprobs[: len(first)] == [-0.1 * i for i in range(len(first))]
    assert set(sample.logprobs[len(first) : len(first) + len(tool)]) == {0.0}
    # the second turn was generated from exactly the recorded sequence
    assert script.seen[1] == sample.prompt_token_ids + first + tool
    rendered = chat.render([Message(role="user", content="What is 2 + 3?")],
                           [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}])
    assert sample.prompt_token_ids == chat.tokens(rendered)


async def test_the_client_sees_tool_calls_logprobs_and_usage(chat, agent_server):
    ep, _ = episode(chat, ["Let me compute. " + CALL])
    key, url = agent_server.open(ep)
    async with openai.AsyncOpenAI(base_url=url, api_key="unused") as client:
        reply = await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "What is 2 + 3?"}], logprobs=True
        )
    agent_server.close(key)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me compute."
    (call,) = choice.message.tool_calls
    assert call.function.name == "calculator" and json.loads(call.function.arguments) == {"expression": "2 + 3"}
    sampled = ep.current.tokens
    returned = [t.logprob for t in choice.logprobs.content]
    assert returned == ep.current.logprobs == [-0.1 * i for i in range(len(sampled))]
    assert "".join(t.token for t in choice.logprobs.content) == chat.tokenizer.decode(sampled)
    assert reply.usage.completion_tokens == len(sampled) and reply.usage.prompt_tokens == len(ep.current.opening)


async def test_streaming_gives_the_same_turn(chat, agent_server):
    ep, _ = episode(chat, [CALL])
    _, url = agent_server.open(ep)
    async with openai.AsyncOpenAI(base_url=url, api_key="unused") as client:
        stream = await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert finishes == ["tool_calls"]
    assert [tc.function.name for tc in calls] == ["calculator"]
    assert chunks[-1].usage.completion_tokens == len(ep.current.tokens)


async def test_a_history_rewrite_splits_the_episode_and_every_part_trains_with_its_advantage(chat, agent_server):
    ep, _ = episode(chat, ["first answer", "second answer", "third answer"])
    key, url = agent_server.open(ep)
    question = [{"role": "user", "content": "What is 2 + 3?"}]
    async with openai.AsyncOpenAI(base_url=url, api_key="unused") as client:
        one = await client.chat.completions.create(model="tiny", messages=question)
        # continues: the reply exactly as returned, then a new user message
        follow = [*question, {"role": "assistant", "content": one.choices[0].message.content},
                  {"role": "user", "content": "Are you sure?"}]
        await client.chat.completions.create(model="tiny", messages=follow)
        assert ep.splits == 0 and ep.calls == 2
        # rewrites: the first answer edited (a summarising agent does this)
        edited = [*question, {"role": "assistant", "content": "5"}, {"role": "user", "content": "Sure?"}]
        await client.chat.completions.create(model="tiny", messages=edited)
    agent_server.close(key)
    assert ep.splits == 1
    sample = ep.sample("g0", 0, reward=1.0, failure=None)
    (segment,) = sample.segments
    model_tokens = len(chat.tokens("first answer")) + len(chat.tokens("second answer")) + 2  # each with its end
    assert segment.loss_mask.count(1) == model_tokens and segment.loss_mask.count(0) > 0
    assert chat.tokenizer.decode(segment.completion_token_ids).startswith("first answer")
    assert "Sure?" in chat.tokenizer.decode(sample.prompt_token_ids)  # the new sequence starts from the edit
    other = msgspec_replace(sample, index=1, reward=0.0, segments=[])
    group = Group(prompt=ep.prompt, samples=[msgspec_replace(sample, reward=1.0), other], advantages=[0.5, -0.5])
    batch, stats = build_batch(0, [group], max_lag=1, max_tokens=512, reward_name="env")
    assert stats["agent_splits"] == 1 and len(batch.samples) == 3
    assert [s.advantage for s in batch.samples] == [0.5, 0.5, -0.5]
    assert batch.samples[0].input_ids == segment.prompt_token_ids + segment.completion_token_ids


async def test_calls_of_two_sessions_are_two_conversations_and_the_sample_is_one_sessions(chat, agent_server):
    ep, _ = episode(chat, ["player one", "coach one", "player two", "coach two"])
    key, url = agent_server.open(ep)
    player = [{"role": "user", "content": "Guess a number."}]
    coach = [{"role": "user", "content": "Cheer the player on."}]
    headers = {"player": {"X-Session-ID": "player"}, "coach": {"X-Session-ID": "coach"}}
    async with openai.AsyncOpenAI(base_url=url, api_key="unused") as client:
        async def ask(messages, who):
            reply = await client.chat.completions.create(model="tiny", messages=messages, extra_headers=headers[who])
            return [*messages, {"role": "assistant", "content": reply.choices[0].message.content}]

        player = await ask(player, "player")
        coach = await ask(coach, "coach")  # interleaved: not a rewrite of the player's conversation
        player = await ask([*player, {"role": "user", "content": "Higher."}], "player")
        await ask([*coach, {"role": "user", "content": "Again."}], "coach")
    agent_server.close(key)
    lanes = {s: (len(lane.closed), lane.calls) for s, lane in ep.lanes.items() if s}
    assert lanes == {"player": (0, 2), "coach": (0, 2)}  # two calls each, no rewrite
    sample = ep.sample("g0", 0, reward=1.0, failure=None, session="player")
    assert sample.segments == [] and sample.turns == 2
    text = chat.tokenizer.decode(sample.completion_token_ids)
    assert text.startswith("player one") and "Higher." in text and text.count("player two") == 1
    assert "coach" not in text and "Cheer" not in chat.tokenizer.decode(sample.prompt_token_ids)
    player_tokens = len(chat.tokens("player one")) + len(chat.tokens("player two")) + 2
    assert sample.loss_mask.count(1) == player_tokens
    # without a session named, the sample is the latest call's (the coach's)
    assert "coach two" in chat.tokenizer.decode(ep.sample("g0", 0, reward=1.0, failure=None).completion_token_ids)


async def test_a_bound_session_selects_its_episode_at_the_runs_one_url_until_the_episode_ends(chat, agent_server):
    """The run's own client (its relay key) reaches a bound session's episode; a session header
    alone is no key."""
    ep, _ = episode(chat, ["bound"])
    key, _ = agent_server.open(ep)
    agent_server.registry.bind("rollout-1", key)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    relay = {"Authorization": f"Bearer {agent_server.relay_key}"}
    async with aiohttp.ClientSession() as http:
        url = f"{agent_server.url}/v1/chat/completions"
        async with http.post(url, json=body, headers={"X-Session-ID": "rollout-1", **relay}) as response:
            assert response.status == 200 and (await response.json())["choices"][0]["message"]["content"] == "bound"
        async with http.post(url, json=body, headers={"X-Session-ID": "rollout-1"}) as response:
            assert response.status == 401  # a session header is no key
        async with http.post(url, json=body, headers={"X-Session-ID": "rollout-2", **relay}) as response:
            assert response.status == 401  # an unbound session
        agent_server.close(key)
        async with http.post(url, json=body, headers={"X-Session-ID": "rollout-1", **relay}) as response:
            assert response.status == 401
    assert ep.lanes["rollout-1"].calls == 1


async def test_a_wrong_key_is_refused_even_with_another_episodes_bound_session(chat, agent_server):
    """The key decides the episode; a session header only chooses among that episode's sessions."""
    mine, _ = episode(chat, ["mine"])
    theirs, _ = episode(chat, ["theirs"])
    my_key, _ = agent_server.open(mine)
    their_key, _ = agent_server.open(theirs)
    agent_server.registry.bind("their-rollout", their_key)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    url = f"{agent_server.url}/v1/chat/completions"
    async with aiohttp.ClientSession() as http:
        for secret in ("wrong", agent_server.api_key(my_key)):
            headers = {"Authorization": f"Bearer {secret}", "X-Session-ID": "their-rollout"}
            async with http.post(url, json=body, headers=headers) as response:
                assert response.status == 401, secret
                assert (await response.json())["error"]["code"] == "invalid_api_key"
    assert all(lane.calls == 0 for ep in (mine, theirs) for lane in ep.lanes.values())
    agent_server.close(my_key)
    agent_server.close(their_key)


def msgspec_replace(sample, **changes):
    import msgspec

    return msgspec.structs.replace(sample, **changes)


async def test_concurrent_episodes_stay_separate(chat, agent_server):
    eps = [episode(chat, [f"answer {i}", f"again {i}"])[0] for i in range(6)]

    async def agent(task, base_url):
        async with openai.AsyncOpenAI(base_url=base_url, api_key="unused") as client:
            messages = list(task.messages)
            for _ in range(2):
                reply = await client.chat.completions.create(model=task.model, messages=messages)
                messages += [reply.choices[0].message.model_dump(exclude_none=True),
                             {"role": "user", "content": "more"}]
        return 0.0

    samples = await asyncio.gather(*(run_agent(agent, ep, agent_server, group_id="g", index=i, timeout_s=30)
                                     for i, ep in enumerate(eps)))
    for i, sample in enumerate(samples):
        text = chat.tokenizer.decode(sample.completion_token_ids)
        assert f"answer {i}" in text and f"again {i}" in text and sample.segments == []
        assert not any(f"answer {j}" in text for j in range(6) if j != i)


@pytest.mark.parametrize(
    ("body", "status", "param", "words"),
    [
        ({"model": "gpt-4o", "messages": [{"role": "user", "content": "x"}]}, 400, "model", "serves the model 'tiny'"),
        ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "temperature": 0.2}, 400, "temperature",
         "samples with temperature = 1.0"),
        ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "n": 3}, 400, "n", "n must be 1"),
        ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "stop": ["\n", ""]}, 400, "stop",
         "non-empty string"),
        ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "temprature": 0.5}, 400, "temprature",
         "unknown field 'temprature' (the chat completions API has no such request field)"),
        ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "functions": []}, 400, "functions",
         "send tools"),
        ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "repetition_penalty": 1.2}, 400,
         "repetition_penalty", "would change the distribution"),
        ({"model": "tiny", "messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role", "unknown role"),
        ({"model": "tiny", "messages": []}, 400, "messages", "non-empty list"),
        ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, 400,
         "tool_choice", "constrained decoding"),
        ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": -1}, 400,
         "max_completion_tokens", "positive integer"),
    ],
)
async def test_requests_the_run_cannot_honour_get_an_openai_error_body(chat, agent_server, body, status, param, words):
    ep, script = episode(chat, ["never"])
    _, url = agent_server.open(ep)
    async with aiohttp.ClientSession() as session, session.post(f"{url}/chat/completions", json=body) as response:
        assert response.status == status
        error = (await response.json())["error"]
    assert error["param"] == param and words in error["message"] and error["type"] == "invalid_request_error"
    assert script.seen == [] and ep.calls == 0  # nothing was generated


async def test_bad_json_an_ended_episode_and_the_openai_client_errors(chat, agent_server):
    ep, _ = episode(chat, ["x"])
    key, url = agent_server.open(ep)
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{url}/chat/completions", data=b"{not json") as response:
            assert response.status == 400 and "not valid JSON" in (await response.json())["error"]["message"]
        agent_server.close(key)
        async with session.post(f"{url}/chat/completions", json={"model": "tiny", "messages": []}) as response:
            assert response.status == 404 and "is not running" in (await response.json())["error"]["message"]
        async with session.get(f"{agent_server.url}/v1/models") as response:
            assert (await response.json())["data"][0]["id"] == "tiny"
    _, url = agent_server.open(ep)
    async with openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0) as client:
        with pytest.raises(openai.BadRequestError, match="samples with temperature"):
            await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                                 temperature=0)


async def raises(task, base_url):
    raise ValueError("no parser for this")


async def returns_text(task, base_url):
    async with openai.AsyncOpenAI(base_url=base_url, api_key="unused") as client:
        await client.chat.completions.create(model=task.model, messages=task.messages)
    return "1.0"


async def hangs(task, base_url):
    await asyncio.sleep(60)


def sync_agent(task, base_url):  # an agent with the synchronous client runs in a thread
    with openai.OpenAI(base_url=base_url, api_key="unused") as client:
        reply = client.chat.completions.create(model=task.model, messages=task.messages)
    return float(len(reply.choices[0].message.content) > 0)


@pytest.mark.parametrize(
    ("agent", "reason"),
    [
        (raises, "agent: raised ValueError: no parser for this"),
        (returns_text, "agent: returned '1.0' (str), expected a finite number or None"),
        (hangs, "agent: timed out after 0.5 s (env.episode_timeout_s)"),
        (sync_agent, None),
    ],
    ids=["raises", "returns-a-string", "hangs", "sync"],
)
async def test_a_failing_agent_makes_its_episode_unscorable_with_the_reason(chat, agent_server, agent, reason):
    ep, _ = episode(chat, ["some answer"])
    sample = await run_agent(agent, ep, agent_server, group_id="g", index=0, timeout_s=0.5 if agent is hangs else 30)
    assert sample.unscorable == reason
    if reason is None:
        assert sample.process_rewards == [(sample.num_tokens - 1, 1.0)]


async def test_the_episode_budget_ends_turns_with_length(chat, agent_server):
    ep, script = episode(chat, ["a b c d e f g h", "more"], max_tokens=12, max_turns=4)
    _, url = agent_server.open(ep)
    async with openai.AsyncOpenAI(base_url=url, api_key="unused") as client:
        one = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "go"}],
                                                   max_tokens=5)
        # cut at the call's own max_tokens: the call's budget, not the episode's
        assert one.choices[0].finish_reason == "length" and one.usage.completion_tokens == 5 and ep.budget is None
        follow = [{"role": "user", "content": "go"}, one.choices[0].message.model_dump(exclude_none=True),
                  {"role": "user", "content": "a much longer message that does not fit in what is left"}]
        two = await client.chat.completions.create(model="tiny", messages=follow)
    assert two.choices[0].finish_reason == "length" and two.choices[0].message.content == ""
    assert len(script.seen) == 1 and len(ep.current.tokens) <= 12 and ep.budget == "tokens"


async def test_a_run_of_agents_labels_every_token_with_the_version_that_computed_it(tmp_path, record_groups):
    """The whole controller on the fake engine (whose token t is a hash of the context and the
    version), weight updates landing in the middle of agents' calls (keep mode): replaying each
    trained sequence shows every model token was computed by exactly the version it is labelled
    with, and the agent's own messages are never in the loss. One call is held after two tokens
    until the first update lands, so at least one call spans versions however fast the rest runs
    (unheld, the engine can finish the first two steps' episodes before the first update)."""
    from rollflow.config import load_config
    from rollflow.controller import Controller
    from rollflow.ledger import summarize
    from rollflow.testing import EOS_TOKEN, FakeEngine, FakeTrainer, NullTransport, context_state, fake_token, mix

    class HoldingEngine(FakeEngine):
        held: str | None = None

        async def _step_wait(self, request_id, context_tokens):
            await super()._step_wait(request_id, context_tokens)
            if self.held is None and len(self._progress[request_id][2]) == 2:
                self.held = request_id
                while self.version == 0:
                    await asyncio.sleep(0.005)

    episodes = iter(range(1000))

    async def agent(task, base_url):  # 2 to 5 calls: short episodes end while long ones go on
        async with openai.AsyncOpenAI(base_url=base_url, api_key="unused") as client:
            messages = list(task.messages)
            for turn in range(2 + next(episodes) % 4):
                reply = await client.chat.completions.create(model=task.model, messages=messages, max_tokens=6)
                messages += [reply.choices[0].message.model_dump(exclude_none=True),
                             {"role": "user", "content": f"turn {turn} done, go on"}]
        return float(len(reply.choices[0].message.content or "") % 3)

    config = load_config(preset="tiny", overrides=["run.max_steps=4", "run.max_lag=1", "sampling.max_tokens=6",
                                                   "env.kind=agent", "env.max_tokens=300", "env.max_turns=5"])
    engine = HoldingEngine(token_delay=0.002)
    controller = Controller(
        config,
        tmp_path,
        agent=agent,
        given=Given(
            engine=engine,
            trainer=FakeTrainer(),
            transport=NullTransport(),
            tokenizer=load_tokenizer(tiny_model_path(0)),
        ),
    )
    result = await asyncio.wait_for(controller.run(), 120)
    assert result.steps == 4 and summarize(tmp_path).ok
    assert engine.held is not None
    turn, _, index = engine.held.partition("#")[0].rpartition("/")  # request ids: GROUP/tN/INDEX[#ATTEMPT]
    held_call, spans, held = (turn.rpartition("/t")[0], index), 0, 0
    for group in record_groups:
        for sample in group.samples:
            assert 2 <= sample.turns <= 5 and sample.segments == []
            state = context_state(sample.prompt_token_ids)
            for token, version, mask in zip(sample.completion_token_ids, sample.versions, sample.loss_mask,
                                            strict=True):
                if mask and token != EOS_TOKEN:
                    assert token == fake_token(state, version, 1000)[0]
                state = mix(state, token)
            agents_text = load_tokenizer(tiny_model_path(0)).decode(
                [t for t, m in zip(sample.completion_token_ids, sample.loss_mask, strict=True) if not m])
            assert "turn 0 done" in agents_text
            spans += len(set(sample.versions)) > 1
            held += held_call == (sample.group_id, str(sample.index))
    assert held == 1, f"the held call's episode ({engine.held}) is not in any batch"
    assert spans > 0, "no episode saw a weight update"


async def test_the_endpoint_listens_on_loopback_only_by_default(agent_server):
    host, port = agent_server.url.removeprefix("http://").split(":")
    assert host == "127.0.0.1"
    assert agent_server._runner.addresses == [("127.0.0.1", int(port))]


async def test_a_call_whose_agent_gave_up_stops_generating(chat, agent_server):
    """The agent times out while its call is generating: the call's generation is cancelled (and
    with it the engine request), not run to its end for nobody."""
    stopped = asyncio.Event()

    async def slow(token_ids, spec, n):
        try:
            await asyncio.sleep(60)
        finally:
            stopped.set()

    prompt = Prompt(id="p1", token_ids=[1], messages=[Message(role="user", content="hi")])
    ep = AgentEpisode(prompt, SPEC, slow, chat, EpisodeLimits())

    async def agent(task, base_url):
        async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
            await client.chat.completions.create(model=task.model, messages=task.messages)

    sample = await run_agent(agent, ep, agent_server, group_id="g", index=0, timeout_s=0.5)
    assert sample.unscorable == "agent: timed out after 0.5 s (env.episode_timeout_s)"
    await asyncio.wait_for(stopped.wait(), 5)


async def test_a_run_whose_agents_all_fail_stops_naming_the_reason(tmp_path):
    """No episode can be scored: #25's stop rule ends the run with the agents' reason, after a
    checkpoint, instead of spinning."""
    from rollflow.config import load_config
    from rollflow.controller import Controller
    from rollflow.errors import TrainingError
    from rollflow.testing import FakeEngine, FakeTrainer, NullTransport

    async def broken(task, base_url):
        async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
            await client.chat.completions.create(model=task.model, messages=task.messages, max_tokens=4)
        raise KeyError("answer")

    config = load_config(preset="tiny", overrides=["run.max_steps=4", "sampling.max_tokens=4"])
    controller = Controller(
        config,
        tmp_path,
        agent=broken,
        given=Given(
            engine=FakeEngine(),
            trainer=FakeTrainer(),
            transport=NullTransport(),
            tokenizer=load_tokenizer(tiny_model_path(0)),
        ),
    )
    with pytest.raises(TrainingError, match="the run cannot learn") as raised:
        await asyncio.wait_for(controller.run(), 60)
    assert "agent: raised KeyError: 'answer' ×16" in str(raised.value)
    assert list((tmp_path / "checkpoints").glob("step-*"))


class _AgentObject:
    """An agent written as an object whose `__call__` is a coroutine function."""

    async def __call__(self, task, base_url):
        return await calculator_agent(task, base_url)


async def test_an_agent_object_with_an_async_call_is_awaited(chat, agent_server):
    ep, _ = episode(chat, [CALL, "5"])
    sample = await run_agent(_AgentObject(), ep, agent_server, group_id="g0", index=0, timeout_s=30)
    assert sample.unscorable is None and sample.process_rewards == [(sample.num_tokens - 1, 1.0)]


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [1]}, "tools[0]"),
        ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
         "tools[0]"),
        ("chat/completions",
         {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": 3}}]},
         "tools[0]"),
    ],
)
async def test_a_malformed_chat_tools_list_is_a_400_naming_the_tool(chat, agent_server, route, body, param):
    """Chat completions refuses what Responses and Messages refuse (a `tools` entry that is not a
    function tool was a bare 500, or was passed to the template as it was)."""
    ep, _ = episode(chat, ["ok"])
    key, base_url = agent_server.open(ep)
    async with aiohttp.ClientSession() as http, http.post(f"{base_url}/{route}", json={"model": "tiny", **body}) as r:
        assert r.status == 400
        assert (await r.json())["error"]["param"] == param
    agent_server.close(key)


async def test_an_anthropic_tool_result_with_no_matching_tool_use_is_a_400(chat, agent_server):
    ep, _ = episode(chat, ["ok"])
    key, base_url = agent_server.open(ep)
    stray = {"type": "tool_result", "tool_use_id": "toolu_nope", "content": "4"}
    body = {"model": "tiny", "max_tokens": 10, "messages": [{"role": "user", "content": [stray]}]}
    async with aiohttp.ClientSession() as http, http.post(f"{base_url}/messages", json=body) as r:
        assert r.status == 400
        error = (await r.json())["error"]
        assert error["type"] == "invalid_request_error" and "toolu_nope" in error["message"]
    agent_server.close(key)


async def test_in_a_multi_agent_episode_the_trained_sample_carries_only_its_agents_budget_and_interruptions(chat):
    """The coach's session runs out of turns and its turn was interrupted by a weight update; the
    player's sample (the trained one) names neither."""
    import msgspec

    script = ScriptedTurns(chat, ["player one", "coach one"])

    async def generate(token_ids, spec, n):
        turn = await script(token_ids, spec, n)
        coaching = "Cheer" in chat.tokenizer.decode(token_ids)
        return msgspec.structs.replace(turn, interruptions=2 if coaching else 0)

    prompt = Prompt(id="p1", token_ids=[1], messages=[Message(role="user", content="Guess.")])
    ep = AgentEpisode(prompt, SPEC, generate, chat, EpisodeLimits(max_turns=1, max_tokens=512))
    await ep.complete([{"role": "user", "content": "Guess a number."}], session="player")
    coach = [{"role": "user", "content": "Cheer the player on."}]
    reply = await ep.complete(coach, session="coach")
    again = [*coach, {"role": "assistant", "content": reply.content}, {"role": "user", "content": "Again."}]
    assert (await ep.complete(again, session="coach")).finish_reason == "length"  # the coach's turns are spent
    player = ep.sample("g0", 0, reward=1.0, failure=None, session="player")
    assert player.budget is None and player.interruptions == 0
    coach_sample = ep.sample("g0", 0, reward=1.0, failure=None, session="coach")
    assert coach_sample.budget == "turns" and coach_sample.interruptions == 2


async def test_a_time_budget_spent_before_the_first_call_is_named_as_such(chat):
    ep, _ = episode(chat, ["late"], time_budget_s=0.01)
    await asyncio.sleep(0.05)
    reply = await ep.complete([{"role": "user", "content": "hi"}])
    assert reply.finish_reason == "length"
    sample = ep.sample("g0", 0, reward=None, failure=None)
    assert sample.unscorable == "agent: env.time_budget_s (0.01 s) was spent before its first turn"
