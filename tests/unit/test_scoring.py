"""Reward functions: TRL signature, sync or async, weighted; every failure is an explicit
unscorable reason, never a 0."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from rollflow.config import RewardConfig, ScoringConfig
from rollflow.controller.setup import Given
from rollflow.errors import ConfigError
from rollflow.records import Message, Prompt
from rollflow.scoring import NO_REWARD, Reward, Scored, Scorer, digits, make_reward, make_rewards

PROMPT = Prompt(
    id="p1",
    token_ids=[1, 2],
    messages=[Message(role="system", content="be brief"), Message(role="user", content="2+3?")],
    answer="5",
    task="arithmetic",
    metadata={"level": 2},
)


async def score(*rewards: Reward, completions=("5", "six", "55")):
    scorer = Scorer(list(rewards), max_concurrency=4)
    try:
        return await scorer.score(PROMPT, list(completions), [[7] * len(c) for c in completions])
    finally:
        await scorer.aclose()


async def test_rewards_get_trl_arguments_and_are_summed_with_weights():
    calls = {}

    def length(prompts, completions, **kwargs):
        calls["sync"] = (prompts, completions, kwargs, threading.current_thread() is threading.main_thread())
        return [float(len(c)) for c in completions]

    async def exact(prompts, completions, answer, **kwargs):
        return [1.0 if c == a else 0.0 for c, a in zip(completions, answer, strict=True)]

    out = await score(Reward("length", length, weight=0.5), Reward("exact", exact, weight=2.0))
    assert [s.reward for s in out] == [0.5 + 2.0, 1.5, 1.0]
    assert out[0].parts == {"length": 1.0, "exact": 1.0} and all(s.reason is None for s in out)
    prompts, completions, kwargs, on_loop = calls["sync"]
    assert prompts == ["2+3?"] * 3 and completions == ["5", "six", "55"]
    assert kwargs["answer"] == ["5"] * 3 and kwargs["task"] == ["arithmetic"] * 3 and kwargs["level"] == [2] * 3
    assert kwargs["completion_ids"] == [[7], [7, 7, 7], [7, 7]] and kwargs["metadata"] == [{"level": 2}] * 3
    assert not on_loop  # sync reward functions run off the event loop


@pytest.mark.parametrize(
    ("func", "reason"),
    [
        (lambda p, c, **k: [1.0, None, 2.0], "returned None"),
        (lambda p, c, **k: [1.0, float("nan"), 2.0], "returned nan"),
        (lambda p, c, **k: [1.0, "high", 2.0], "returned 'high' (str), expected a number or None"),
        (lambda p, c, **k: [1.0, True, 2.0], "returned True (bool), expected a number or None"),
    ],
)
async def test_a_bad_value_makes_only_its_sample_unscorable(func, reason):
    out = await score(Reward("r", func))
    assert [s.reward for s in out] == [1.0, None, 2.0]
    assert out[1].reason == f"reward r: {reason}" and out[1].parts == {}


def _raises(prompts, completions, **kwargs):
    raise ValueError("no number in the completion")


def _hangs(prompts, completions, **kwargs):
    time.sleep(1.0)
    return [1.0] * len(completions)


async def _hangs_async(prompts, completions, **kwargs):
    await asyncio.sleep(10)


@pytest.mark.parametrize(
    ("func", "reason"),
    [
        (_raises, "raised ValueError: no number in the completion"),
        (_hangs, "timed out after 0.2 s"),
        (_hangs_async, "timed out after 0.2 s"),
        (lambda p, c, **k: [1.0], "returned 1 values for 3 completions"),
        (lambda p, c, **k: 1.0, "returned float for 3 completions"),
    ],
)
async def test_a_failed_call_makes_every_sample_of_the_call_unscorable(func, reason):
    out = await score(Reward("ok", lambda p, c, **k: [1.0] * len(c)), Reward("bad", func, timeout_s=0.2))
    assert [s.reward for s in out] == [None, None, None]  # never 0, and never the other reward alone
    assert {s.reason for s in out} == {f"reward bad: {reason}"}


def test_configured_rewards_resolve_or_name_the_field():
    assert [r.name for r in make_rewards(ScoringConfig(), "digits")] == ["digits"]
    given = {"mine": lambda p, c, **k: [0.0] * len(c)}
    assert [r.name for r in make_rewards(ScoringConfig(), "digits", given)] == ["mine"]
    configured = ScoringConfig(rewards=[RewardConfig(name="verifier", weight=0.5), RewardConfig(name="mine")])
    rewards = make_rewards(configured, "digits", given)
    assert [(r.name, r.weight) for r in rewards] == [("verifier", 0.5), ("mine", 1.0)]
    function = make_reward(RewardConfig(name="x", function="rollflow.scoring:digits"), 0)
    assert function.func([""], ["a1"]) == [0.5]
    with pytest.raises(ConfigError, match=r"scoring.rewards\[0\]: 'nope' is not a built-in reward"):
        make_reward(RewardConfig(name="nope"), 0)
    with pytest.raises(ConfigError, match=r"scoring.rewards\[2\].function: cannot import module 'no_such_mod'"):
        make_reward(RewardConfig(name="x", function="no_such_mod:f"), 2)
    with pytest.raises(ConfigError, match=r"scoring.rewards\[0\].function: expected 'module:function'"):
        make_reward(RewardConfig(name="x", function="digits"), 0)
    with pytest.raises(ConfigError, match="not both"):
        make_reward(RewardConfig(name="x", function="a:b", url="http://127.0.0.1:1/"), 0)
    with pytest.raises(ConfigError, match="environment variable ROLLFLOW_NO_SUCH_TOKEN"):
        make_reward(RewardConfig(name="x", url="http://127.0.0.1:1/", token_env="ROLLFLOW_NO_SUCH_TOKEN"), 0)


def test_teacher_log_probs_become_centred_per_token_reverse_kl_advantages():
    from rollflow.batch import build_batch
    from rollflow.records import Group, Sample, SamplingSpec

    def sample(i, behaviour, teacher):
        return Sample(
            prompt_id="p", group_id="g", index=i, prompt_token_ids=[1], completion_token_ids=[5] * len(behaviour),
            logprobs=behaviour, versions=[0] * len(behaviour), loss_mask=[1] * len(behaviour), finish_reason="stop",
            sampling=SamplingSpec(), reward=1.0, teacher_logprobs=teacher,
        )

    group = Group(
        prompt=PROMPT,
        samples=[sample(0, [-1.0, -2.0], [-1.0, -1.0]), sample(1, [-3.0], [-4.0])],
        advantages=[0.5, -0.5],
    )
    batch, stats = build_batch(0, [group], max_lag=0, max_tokens=4, reward_name="r", distill_coef=2.0)
    # Gaps teacher - behaviour: 0, +1 and -1; their mean (the baseline) is 0.
    assert [s.token_advantages for s in batch.samples] == [[0.5, 2.5], [-2.5]]
    assert stats["teacher_kl"] == pytest.approx(0.0) and stats["teacher_gap_abs_max"] == 1.0
    plain, _ = build_batch(0, [group], max_lag=0, max_tokens=4, reward_name="r")
    assert [s.token_advantages for s in plain.samples] == [None, None]  # no coefficient: sequence advantages


async def test_process_rewards_are_validated_weighted_and_summed():
    def prm(prompts, completions, completion_ids, **kwargs):
        return [[[0, 0.5], [len(ids) - 1, 1.0]] for ids in completion_ids[:2]] + [[[99, 1.0]]]

    scored = await score(Reward("prm", prm, weight=2.0, process=True))
    assert scored[0].reward == pytest.approx(3.0) and scored[0].parts == {"prm": 1.5}
    assert scored[0].steps == [(0, 1.0), (0, 2.0)]  # "5" is one token here: both steps end at it
    assert scored[1].steps == [(0, 1.0), (2, 2.0)]
    assert scored[2].reward is None and "step end 99, expected a token index in [0, 2)" in (scored[2].reason or "")

    def bad(prompts, completions, **kwargs):
        return [[[0, float("nan")]], 3.0, [["a", 1.0]]]

    reasons = [s.reason for s in await score(Reward("prm", bad, process=True))]
    assert "step at token 0 returned nan" in reasons[0]
    assert "expected a list of [token_index, reward] pairs" in reasons[1]
    assert "step end 'a'" in reasons[2]


async def test_an_environment_reward_adds_to_the_functions_and_its_failure_wins():
    prior = [Scored(1.0, None, {"env": 1.0}, [(0, 1.0)]), Scored(None, "environment: step raised X"), Scored(None)]
    scorer = Scorer([Reward("digits", digits, weight=0.5, inline=True)])
    scored = await scorer.score(PROMPT, ["5", "6", "ab"], [[1], [1], [1, 2]], prior)
    assert scored[0] == Scored(1.5, None, {"env": 1.0, "digits": 1.0}, [(0, 1.0)])
    assert scored[1].reward is None and scored[1].reason == "environment: step raised X"
    assert scored[2] == Scored(0.0, None, {"digits": 0.0})
    alone = await Scorer([]).score(PROMPT, ["5", "6"], [[1], [1]], [*prior[:1], Scored(None)])
    assert alone[0].reward == 1.0 and alone[1].reason == NO_REWARD


@pytest.mark.timeout(60)
async def test_a_slow_reward_runs_beside_generation_within_its_concurrency_bound(tmp_path):
    from rollflow.config import load_config
    from rollflow.controller import Controller
    from rollflow.testing import FakeEngine, FakeTokenizer, FakeTrainer, NullTransport

    # Completions of 2 to 16 tokens: groups finish generating at different times.
    engine = FakeEngine(token_delay=0.01, length_fn=lambda ids: 2 + sum(ids) % 15)
    running, most, live_during = 0, 0, []

    lock = threading.Lock()

    def slow_judge(prompts, completions, **kwargs):  # sync: runs on the scoring threads
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
        before = engine.tokens_generated
        time.sleep(0.1)
        live_during.append(engine.tokens_generated - before)  # tokens decoded while this call ran
        with lock:
            running -= 1
        return [1.0] * len(completions)

    config = load_config(
        preset="tiny",
        overrides=["run.max_steps=3", "run.max_lag=2", "scoring.max_concurrency=2", "observe.sinks=[]"],
    )
    controller = Controller(
        config,
        tmp_path,
        reward_funcs={"judge": slow_judge},
        given=Given(engine=engine, trainer=FakeTrainer(), transport=NullTransport(), tokenizer=FakeTokenizer()),
    )
    result = await asyncio.wait_for(controller.run(), 50)
    assert result.steps == 3
    assert most == 2  # the bound is reached and never passed
    assert max(live_during) > 0  # the engine kept generating while a reward was computed
