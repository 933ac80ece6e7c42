"""Multi-turn episodes with scripted model turns: token layout, masks, versions, tool failures."""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest

from rollflow.controller.setup import Given
from rollflow.envs import EnvStep, EpisodeLimits, episode_score, load_environment, run_episode
from rollflow.envs.calculator import CalculatorEnv
from rollflow.envs.retry import TRY_AGAIN, RetryEnv
from rollflow.envs.tools import ToolCall, call_tool, parse_tool_calls
from rollflow.errors import ConfigError
from rollflow.records import Message, Prompt, Sample, SamplingSpec

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "3 * 4"}}</tool_call>'


def prompt(answer="12"):
    return Prompt(
        id="p1",
        token_ids=[1, 2, 3],
        messages=[Message(role="user", content="What is 3 * 4?")],
        answer=answer,
        task="arithmetic",
    )


def scripted(chat, texts, versions=None):
    """A model that says `texts[n]` (then its end marker) at turn n, under version `versions[n]`."""
    calls = []

    async def generate(token_ids, spec, n):
        ids = chat.tokens(texts[n] + chat.eos_text)[: spec.max_tokens]
        version = versions[n] if versions else 0
        calls.append((list(token_ids), spec.max_tokens))
        finish = "stop" if len(ids) == len(chat.tokens(texts[n] + chat.eos_text)) else "length"
        return Sample(
            prompt_id="p1",
            group_id="g",
            index=0,
            prompt_token_ids=token_ids,
            completion_token_ids=ids,
            logprobs=[-0.5] * len(ids),
            versions=[version] * len(ids),
            loss_mask=[1] * len(ids),
            finish_reason=finish,
            sampling=spec,
        )

    generate.calls = calls  # type: ignore[attr-defined]
    return generate


async def episode(chat, env, texts, versions=None, **limits):
    generate = scripted(chat, texts, versions)
    sample = await run_episode(
        env, prompt(), SamplingSpec(max_tokens=64), generate, chat, group_id="g", index=0,
        limits=EpisodeLimits(**limits),
    )
    return sample, generate.calls  # type: ignore[attr-defined]


def model_spans(sample):
    return model_spans_of(sample.loss_mask)


def model_spans_of(loss_mask):
    """(start, end) of each run of loss-mask-1 tokens."""
    spans, start = [], None
    for i, m in enumerate([*loss_mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append((start, i))
            start = None
    return spans


@pytest.mark.timeout(60)
async def test_tool_episode_layout_masks_versions_and_reward(chat):
    env = CalculatorEnv()
    sample, calls = await episode(chat, env, [CALL, "The answer is 12"], versions=[3, 4])
    tok = chat.tokenizer
    turn0 = chat.tokens(CALL + chat.eos_text)
    turn1 = chat.tokens("The answer is 12" + chat.eos_text)
    # The model's tokens are exactly what it sampled, and the mask covers exactly them.
    spans = model_spans(sample)
    assert [sample.completion_token_ids[a:b] for a, b in spans] == [turn0, turn1]
    env_tokens = sample.completion_token_ids[spans[0][1] : spans[1][0]]
    reply = "\n<|im_start|>tool\n12<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(env_tokens, skip_special_tokens=False) == reply
    # The whole sequence is the chat template's rendering of the conversation.
    conversation = [
        {"role": "system", "content": env_system()},
        {"role": "user", "content": "What is 3 * 4?"},
        {"role": "assistant", "content": CALL},
        {"role": "tool", "content": "12"},
        {"role": "assistant", "content": "The answer is 12"},
    ]
    full = tok.apply_chat_template(conversation, tokenize=False)
    assert tok.decode(sample.prompt_token_ids + sample.completion_token_ids, skip_special_tokens=False) == full.rstrip(
        "\n"
    )
    # Versions: each model token its turn's version, environment tokens the version before them.
    assert sample.versions == [3] * len(turn0) + [3] * len(env_tokens) + [4] * len(turn1)
    assert sample.logprobs[spans[0][1] : spans[1][0]] == [0.0] * len(env_tokens)
    # The second turn was generated from the whole sequence so far.
    assert calls[1][0] == sample.prompt_token_ids + sample.completion_token_ids[: spans[1][0]]
    assert sample.turns == 2 and sample.unscorable is None and sample.finish_reason == "stop"
    assert sample.process_rewards == [(len(sample.completion_token_ids) - 1, 1.0)]
    assert env.tool_calls == 1


def env_system():
    from rollflow.envs.calculator import SYSTEM

    return SYSTEM


@pytest.mark.timeout(60)
async def test_a_hanging_tool_times_out_and_a_raising_tool_is_an_observation(chat):
    def hangs(expression):
        time.sleep(3)
        return "never"

    def raises(expression):
        raise RuntimeError("boom")

    began = time.monotonic()
    env = CalculatorEnv(tool_timeout_s=0.2, tools={"calculator": hangs})
    sample, _ = await episode(chat, env, [CALL, "12"])
    assert time.monotonic() - began < 2.5
    text = chat.tokenizer.decode(sample.completion_token_ids, skip_special_tokens=True)
    assert "error: tool calculator timed out after 0.2 s" in text
    assert sample.turns == 2 and sample.process_rewards[-1][1] == 1.0

    env = CalculatorEnv(tools={"calculator": raises})
    sample, _ = await episode(chat, env, [CALL, "12"])
    text = chat.tokenizer.decode(sample.completion_token_ids, skip_special_tokens=True)
    assert "error: tool calculator raised RuntimeError: boom" in text and sample.unscorable is None


async def test_tool_call_parsing_and_errors():
    assert parse_tool_calls(CALL) == ([ToolCall("calculator", {"expression": "3 * 4"})], None)
    assert parse_tool_calls("no call") == ([], None)
    calls, error = parse_tool_calls("<tool_call>{not json</tool_call>")
    assert calls == [] and error is not None and "not valid JSON" in error
    assert "arguments must be" in (parse_tool_calls('<tool_call>{"name": "x", "arguments": 3}</tool_call>')[1] or "")
    tools = {"calculator": lambda expression: "ok"}
    assert "unknown tool 'search'" in await call_tool(tools, ToolCall("search", {}), 1.0)
    assert "TypeError" in await call_tool(tools, ToolCall("calculator", {"x": 1}), 1.0)

    async def slow(**kwargs):
        await asyncio.sleep(5)

    assert "timed out after 0.05 s" in await call_tool({"slow": slow}, ToolCall("slow", {}), 0.05)


class Broken:
    def __init__(self, hang=False):
        self.hang = hang

    async def reset(self, prompt):
        return list(prompt.messages)

    async def step(self, turn):
        if self.hang:
            await asyncio.sleep(10)
        raise ValueError("bad state")


@pytest.mark.timeout(60)
async def test_an_environment_that_raises_or_hangs_makes_the_episode_unscorable(chat):
    sample, _ = await episode(chat, Broken(), ["5"])
    assert sample.unscorable == "environment: step raised ValueError: bad state"
    sample, _ = await episode(chat, Broken(hang=True), ["5"], step_timeout_s=0.1)
    assert sample.unscorable == "environment: step timed out after 0.1 s"

    class BrokenReset(Broken):
        async def reset(self, prompt):
            raise KeyError("no such level")

    sample, calls = await episode(chat, BrokenReset(), ["5"])
    assert sample.unscorable == "environment: reset raised KeyError: 'no such level'" and calls == []
    assert sample.prompt_token_ids == prompt().token_ids and sample.completion_token_ids == []


class Answers(Broken):
    """Answers every turn with `result` (whatever a user's environment might return)."""

    def __init__(self, result, opening=None):
        super().__init__()
        self.result, self.opening, self.closed = result, opening, 0

    async def reset(self, prompt):
        return self.opening if self.opening is not None else list(prompt.messages)

    async def step(self, turn):
        return self.result

    async def aclose(self):
        self.closed += 1


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("result", "opening", "reason"),
    [
        (None, None, "environment: step returned None (NoneType), expected an EnvStep"),
        ("done", None, "environment: step returned 'done' (str), expected an EnvStep"),
        (EnvStep(reward="1.0", done=True), None, "environment: step returned reward '1.0' (str), expected a finite"),
        (EnvStep(reward=float("nan"), done=True), None, "environment: step returned reward nan (float), expected a"),
        (EnvStep(reward=True, done=True), None, "environment: step returned reward True (bool), expected a finite"),
        (EnvStep(messages=["hi"]), None, "environment: step returned messages ['hi'] (list), expected a list of"),
        (EnvStep(done=True), "hello", "environment: reset returned 'hello' (str), expected a list of Message"),
    ],
    ids=["none", "string", "string-reward", "nan-reward", "bool-reward", "bad-messages", "bad-reset"],
)
async def test_what_an_environment_returns_is_checked_and_a_bad_value_is_the_episode_unscorable(
    chat, result, opening, reason
):
    env = Answers(result, opening)
    sample, _ = await episode(chat, env, ["5"])
    assert sample.unscorable is not None and sample.unscorable.startswith(reason), sample.unscorable
    assert sample.process_rewards == [] and env.closed == 1
    assert episode_score(sample).reward is None  # never a NaN or a coerced string in the loss


@pytest.mark.timeout(60)
async def test_an_environment_is_closed_when_its_episode_raises(chat):
    env = Answers(EnvStep(messages=[Message(role="user", content="again")]))

    async def generate(token_ids, spec, n):
        raise RuntimeError("engine gone")

    with pytest.raises(RuntimeError, match="engine gone"):
        await run_episode(env, prompt(), SamplingSpec(max_tokens=64), generate, chat, group_id="g", index=0,
                          limits=EpisodeLimits())
    assert env.closed == 1


@pytest.mark.timeout(60)
async def test_retry_environment_turns_budget_and_process_rewards(chat):
    sample, _ = await episode(chat, RetryEnv(), ["7", "9", "12"])
    assert sample.turns == 3 and sample.finish_reason == "stop"
    assert [r for _, r in sample.process_rewards] == [0.0, 0.0, 0.5]
    ends = [e for e, _ in sample.process_rewards]
    assert all(sample.loss_mask[e] == 1 for e in ends)  # each step ends on the model's last token
    assert chat.tokenizer.decode(sample.completion_token_ids, skip_special_tokens=True).count("Try again") == 2

    sample, _ = await episode(chat, RetryEnv(), ["7"] * 10, max_turns=2)
    assert sample.turns == 2 and [r for _, r in sample.process_rewards] == [0.0, 0.0]

    # The episode budget covers the environment's tokens too; the last turn gets what is left.
    sample, calls = await episode(chat, RetryEnv(), ["7 7 7 7 7 7"] * 10, max_tokens=30, max_turns=10)
    assert len(sample.completion_token_ids) <= 30 and sample.finish_reason == "length"
    assert calls[-1][1] == 30 - (len(calls[-1][0]) - len(sample.prompt_token_ids))


def test_load_environment_names_the_field():
    assert isinstance(load_environment("calculator")(), CalculatorEnv)
    assert isinstance(load_environment("rollflow.envs.retry:RetryEnv")(), RetryEnv)
    with pytest.raises(ConfigError, match="env.name"):
        load_environment("nope")
    with pytest.raises(ConfigError, match="env.name: cannot import"):
        load_environment("no_such_module:Env")


@pytest.mark.timeout(120)
async def test_controller_trains_episodes_with_environment_tokens_masked(tmp_path, chat):
    from rollflow.config import load_config
    from rollflow.controller import Controller
    from rollflow.testing import FakeEngine, FakeTrainer, NullTransport

    config = load_config(
        preset="tiny",
        overrides=[
            "env.kind=tool",
            "env.name=retry",
            "env.max_turns=3",
            "env.max_tokens=60",
            "sampling.max_tokens=6",
            "scoring.process_coef=1.0",
            "run.max_steps=3",
            "run.max_lag=0",  # no token withheld as stale: the mask is the environment's alone
        ],
    )
    trainer = FakeTrainer()
    controller = Controller(
        config,
        tmp_path,
        given=Given(
            engine=FakeEngine(token_delay=0.001),
            trainer=trainer,
            transport=NullTransport(),
            tokenizer=chat.tokenizer,
        ),
    )
    result = await asyncio.wait_for(controller.run(), 100)
    assert result.steps == 3 and all(m["turns_mean"] > 1 for m in result.metrics)
    assert all(m["unscorable"] == 0 for m in result.metrics)
    assert {"env"} == set(result.metrics[0]["rewards"])  # the environment alone gives the rewards
    reply = f"\n<|im_start|>user\n{TRY_AGAIN}<|im_end|>\n<|im_start|>assistant\n"
    for batch in trainer.batches:
        for s in batch.samples:
            completion = s.input_ids[s.prompt_len :]
            # The random fake model never answers right: every turn but the last is followed by
            # the reply (after the end marker the model did not write when its turn was cut).
            # Exactly the reply's tokens are out of the loss.
            masked = [t for t, m in zip(completion, s.loss_mask, strict=True) if not m]
            runs = [completion[a:b] for a, b in model_spans_of(s.loss_mask)]
            expected = []
            for run in runs[:-1]:
                cut = run[-1] != chat.tokenizer.eos_token_id
                expected += chat.tokens(("<|im_end|>" if cut else "") + reply)
            assert len(runs) >= 2 and masked == expected
            assert s.token_advantages is not None and len(s.token_advantages) == len(completion)


@pytest.mark.timeout(120)
async def test_stop_and_resume_restarts_unfinished_episodes_and_keeps_finished_ones(tmp_path, chat, record_groups):

    from rollflow.checkpoint import latest_checkpoint, read_state
    from rollflow.config import load_config
    from rollflow.controller import Controller
    from rollflow.ledger import summarize
    from rollflow.testing import FakeEngine, FakeTrainer, NullTransport

    created = itertools.count()
    hanging = [True]

    class SlowRetry(RetryEnv):
        """After the first two steps' episodes (8 groups of 4), every other episode hangs: the
        groups in flight at the stop have finished episodes and unfinished ones."""

        def __init__(self):
            super().__init__()
            n = next(created)
            self.hangs = hanging[0] and n >= 32 and n % 2 == 1

        async def step(self, turn):
            if self.hangs:
                await asyncio.sleep(60)
            return await super().step(turn)

    def make(**kwargs):
        config = load_config(
            preset="tiny",
            overrides=["env.kind=tool", "env.max_turns=3", "env.max_tokens=80", "sampling.max_tokens=8",
                       "run.max_steps=5", "run.max_lag=1", "observe.sinks=[]"],
        )
        return Controller(
            config,
            tmp_path,
            env=SlowRetry,
            **kwargs,
            given=Given(
                engine=FakeEngine(token_delay=0.002),
                trainer=FakeTrainer(step_s=0.3),
                transport=NullTransport(),
                tokenizer=chat.tokenizer,
            ),
        )

    first = make(on_step=lambda row: row["step"] == 1 and first.request_stop())
    assert (await asyncio.wait_for(first.run(), 60)).stopped
    state = read_state(latest_checkpoint(tmp_path))
    saved = [s for group in state.in_flight for s in group.samples]
    finished = {(s.done.prompt_id, s.done.index): s.done for s in saved if s.done is not None}
    assert saved and all(s.tokens == [] for s in saved)  # an unfinished episode is saved as not started
    assert finished, "the checkpoint should hold finished episodes of unfinished groups"
    trained = record_groups
    hanging[0] = False
    resumed = await asyncio.wait_for(make(resume=True).run(), 60)
    assert resumed.steps == 3 and summarize(tmp_path).ok
    kept = [s for g in trained for s in g.samples if (s.prompt_id, s.index) in finished]
    assert len(kept) == len(finished)
    for sample in kept:
        assert sample.completion_token_ids == finished[(sample.prompt_id, sample.index)].completion_token_ids
