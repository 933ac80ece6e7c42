"""The built-in `math_verify` reward: math-verify's own judgement, in worker processes that a
hostile completion cannot hang: every call is bounded and a timeout is a reason, not a 0."""

from __future__ import annotations

import asyncio
import time

import pytest

from rollflow.config import RewardConfig, ScoringConfig
from rollflow.records import Prompt
from rollflow.scoring import Scorer, Unscorable, make_rewards
from rollflow.scoring.math_verify import MathVerify

HOSTILE = "\\boxed{(10^{10})!}"
"""A completion whose comparison with a small number runs far past any timeout."""
HOSTILE_ANSWER = "1"


@pytest.fixture
async def judge():
    reward = MathVerify(workers=2, deadline_s=8.0, parse_timeout_s=2)
    yield reward
    await reward.aclose()


async def test_equivalent_forms_are_right_and_other_answers_wrong(judge):
    completions = ["The answer is $\\frac{1}{2}$", "so \\boxed{0.5}", "x = 1/2", "it is 3", "no idea"]
    assert await judge(["q"] * 5, completions, answer=["1/2"] * 5) == [1.0, 1.0, 1.0, 0.0, 0.0]
    assert await judge(["q"] * 2, ["\\boxed{2}", "$\\{1, 2\\}$"], answer=["\\frac{4}{2}", "\\{2, 1\\}"]) == [1.0, 1.0]


async def test_a_completion_past_the_timeout_is_unscorable_with_the_reason(judge):
    began = time.monotonic()
    (value,) = await judge(["q"], [HOSTILE], answer=[HOSTILE_ANSWER])
    assert value == Unscorable("math_verify: timed out after 2 s comparing the answers")
    assert time.monotonic() - began < 8
    assert await judge(["q"], ["\\boxed{4}"], answer=["4"]) == [1.0]  # the worker goes on


async def test_a_worker_that_does_not_answer_in_time_is_killed_and_replaced():
    judge = MathVerify(workers=1, deadline_s=0.5, parse_timeout_s=30)  # math-verify's own timeout too late
    try:
        (value,) = await judge(["q"], [HOSTILE], answer=[HOSTILE_ANSWER])
        assert value == Unscorable("math_verify: no judgement within 0.5 s (the worker was stopped)")
        judge.deadline_s = 20.0  # a new worker starts (imports included) and judges the next one
        assert await judge(["q"], ["\\boxed{4}"], answer=["4"]) == [1.0]
    finally:
        await judge.aclose()


async def test_rows_without_a_usable_answer_are_unscorable(judge):
    values = await judge(["q"] * 2, ["\\boxed{4}", "\\boxed{4}"], answer=[None, "  "])
    assert values == [Unscorable("math_verify: the prompt has no answer to compare with")] * 2


async def test_a_group_is_judged_by_the_workers_at_once_and_cancelling_kills_them(judge):
    values = await judge(["q"] * 8, [f"\\boxed{{{i}}}" for i in range(8)], answer=["3"] * 8)
    assert values == [1.0 if i == 3 else 0.0 for i in range(8)]
    call = asyncio.ensure_future(judge(["q"] * 2, [HOSTILE] * 2, answer=[HOSTILE_ANSWER] * 2))
    await asyncio.sleep(0.5)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert judge._all == set() and judge._idle == []  # the busy workers were stopped, none left behind


async def test_the_configured_reward_reports_reasons_per_sample():
    rewards = make_rewards(ScoringConfig(rewards=[RewardConfig(name="math_verify")]), "verifier", task="jsonl")
    scorer = Scorer(rewards)
    prompt = Prompt(id="p", token_ids=[1], answer="\\frac{3}{4}")
    try:
        scored = await scorer.score(prompt, ["$0.75$", "$3/5$"], [[1], [1]])
    finally:
        await scorer.aclose()
    assert [s.reward for s in scored] == [1.0, 0.0] and scored[0].parts == {"math_verify": 1.0}
