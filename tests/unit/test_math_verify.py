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


async def test_a_group_is_judged_by_the_workers_at_once(judge):
    values = await judge(["q"] * 8, [f"\\boxed{{{i}}}" for i in range(8)], answer=["3"] * 8)
    assert values == [1.0 if i == 3 else 0.0 for i in range(8)]


SLOW = "\\boxed{(10^{5})!}"
"""A completion whose comparison takes about a second and finishes within the timeout."""


async def test_a_cancelled_group_lets_its_judgements_finish_and_keeps_the_workers(judge):
    assert await judge(["q"] * 2, ["\\boxed{1}", "\\boxed{2}"], answer=["1"] * 2) == [1.0, 0.0]
    workers = set(judge._all)
    call = asyncio.ensure_future(judge(["q"] * 2, [SLOW] * 2, answer=["1"] * 2))
    while len(judge._jobs) < 2:  # both workers are mid-judgement (not a fixed sleep: a loaded
        await asyncio.sleep(0.01)  # machine can take longer to start them than they take to judge)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert judge._all == workers and all(w.process.returncode is None for w in workers)
    while judge._jobs:  # the judgements finish on their own, within their deadline
        await asyncio.sleep(0.05)
    assert sorted(map(id, judge._idle)) == sorted(map(id, workers))
    assert await judge(["q"], ["\\boxed{4}"], answer=["4"]) == [1.0] and judge._all == workers


async def test_under_load_a_group_waits_for_workers_without_timing_out(monkeypatch):
    """One worker for 48 completions of 6 groups scored at once: each judgement is bounded, the
    wait for the worker is not, so no group times out for the others (it did, as a whole, when
    the reward's 0.5 s limit covered the group's call)."""
    from rollflow.scoring import math_verify

    monkeypatch.setattr(math_verify, "WORKERS", 1)
    rewards = make_rewards(ScoringConfig(rewards=[RewardConfig(name="math_verify", timeout_s=0.5)]), "verifier")
    scorer = Scorer(rewards)
    prompt = Prompt(id="p", token_ids=[1], answer="\\frac{3}{4}")
    completions = ["$0.75$", "$3/5$", "\\boxed{\\frac{6}{8}}", "no", "1", "2", "3", "$\\frac{3}{4}$"]
    try:
        groups = await asyncio.gather(*(scorer.score(prompt, completions, [[1]] * 8) for _ in range(6)))
    finally:
        await scorer.aclose()
    for scored in groups:
        assert [s.reward for s in scored] == [1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0], scored[0].reason


async def test_a_reference_answer_whose_parse_timed_out_once_is_parsed_again():
    from math_verify.errors import TimeoutException

    from rollflow.scoring import math_worker

    real = math_worker.parse
    calls = []

    def once_too_slow(text, **kwargs):
        calls.append(text)
        if len(calls) == 1:
            raise TimeoutException("too slow this time")
        return real(text, **kwargs)

    math_worker.parse = once_too_slow
    try:
        request = math_worker.Request(gold="\\frac{7}{9}", text="\\boxed{\\frac{7}{9}}", timeout_s=3)
        first = math_worker.judge(request)
        second = math_worker.judge(request)
    finally:
        math_worker.parse = real
    assert first.error is not None and first.error.startswith("timed out after 3 s parsing the answer")
    assert second == math_worker.Judgement(value=1.0)


async def test_reference_answers_that_are_words_are_unscorable_not_zero(judge):
    values = await judge(["q"] * 3, ["Paris", "London", "yes"], answer=["Paris", "Paris", "yes"])
    assert all(isinstance(v, Unscorable) and "is not math" in v.reason for v in values), values
    assert values[0].reason.startswith("math_verify: the answer 'Paris' is not math")
    assert await judge(["q"] * 2, ["$x y$", "\\boxed{\\pi}"], answer=["x y", "$\\pi$"]) == [1.0, 1.0]


async def test_the_configured_reward_reports_reasons_per_sample():
    rewards = make_rewards(ScoringConfig(rewards=[RewardConfig(name="math_verify")]), "verifier")
    scorer = Scorer(rewards)
    prompt = Prompt(id="p", token_ids=[1], answer="\\frac{3}{4}")
    try:
        scored = await scorer.score(prompt, ["$0.75$", "$3/5$"], [[1], [1]])
    finally:
        await scorer.aclose()
    assert [s.reward for s in scored] == [1.0, 0.0] and scored[0].parts == {"math_verify": 1.0}
