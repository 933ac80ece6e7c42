"""Group-relative advantages by hand, equal-reward groups and unscorable samples."""

from __future__ import annotations

import math

import pytest

from rollflow.advantage import group_advantages


def test_grpo_by_hand():
    out = group_advantages([1.0, 0.0, 0.0, 1.0])
    z = 0.5 / math.sqrt(1 / 3)
    assert out.advantages == pytest.approx([z, -z, -z, z], rel=1e-5)
    assert not out.degenerate and out.unscorable == 0
    assert group_advantages([1.0, 0.0, 0.0, 1.0], scale_std=False).advantages == [0.5, -0.5, -0.5, 0.5]


def test_rloo_by_hand():
    assert group_advantages([1.0, 0.0, 0.0], estimator="rloo").advantages == pytest.approx([1.0, -0.5, -0.5])


@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
def test_equal_rewards_give_zero_advantage(estimator):
    out = group_advantages([0.7, 0.7, 0.7], estimator=estimator)
    assert out.advantages == [0.0, 0.0, 0.0] and out.degenerate


def test_unscorable_samples_are_excluded_and_counted():
    out = group_advantages([1.0, None, 0.0, float("nan")])
    assert out.unscorable == 2
    assert out.advantages[1] == 0.0 and out.advantages[3] == 0.0
    # The baseline uses only the two scorable rewards: mean 0.5, sample std sqrt(0.5).
    z = 0.5 / math.sqrt(0.5)
    assert out.advantages[0] == pytest.approx(z, rel=1e-5) and out.advantages[2] == pytest.approx(-z, rel=1e-5)
    lone = group_advantages([1.0, None, None])
    assert lone.advantages == [0.0, 0.0, 0.0] and lone.unscorable == 2 and lone.degenerate


def test_process_advantages_by_hand():
    from rollflow.advantage import process_advantages

    # Step rewards 1, 0 (sample 0) and 0, 1 (sample 1): mean 0.5, std sqrt(1/3); unscaled here.
    steps = [[(1, 1.0), (3, 0.0)], [(0, 0.0), (2, 1.0)], None]
    out = process_advantages(steps, [4, 3, 5], scale_std=False)
    assert out[0] == pytest.approx([0.0, 0.0, -0.5, -0.5])  # tokens 0-1 earn +0.5 and -0.5
    assert out[1] == pytest.approx([0.0, 0.5, 0.5])
    assert out[2] is None  # unscorable
    scaled = process_advantages(steps, [4, 3, 5])
    std = math.sqrt(1 / 3)
    assert scaled[1] == pytest.approx([0.0, 0.5 / std, 0.5 / std], rel=1e-5)
    # Equal step rewards carry no signal; a step outside the completion is an error.
    assert process_advantages([[(0, 1.0)], [(1, 1.0)]], [2, 2]) == [[0.0, 0.0], [0.0, 0.0]]
    with pytest.raises(ValueError, match="outside"):
        process_advantages([[(5, 1.0)], [(0, 0.0)]], [2, 2])


def test_dapos_soft_overlong_penalty_by_hand():
    from rollflow.advantage import overlong_penalty

    # Budget 100, buffer 20: free up to 80 tokens, then -1/20 per token, -1 at the budget.
    assert [overlong_penalty(n, 100, 20) for n in (10, 80, 81, 90, 100, 120)] == [0.0, 0.0, -0.05, -0.5, -1.0, -1.0]


def test_overlong_filter_keeps_the_reward_in_the_baseline_but_not_the_tokens_in_the_loss():
    from rollflow.batch import build_batch
    from rollflow.records import Group, Prompt, Sample, SamplingSpec

    def sample(i, finish, reward):
        return Sample(
            prompt_id="p", group_id="g", index=i, prompt_token_ids=[1], completion_token_ids=[5, 6, 7],
            logprobs=[-1.0] * 3, versions=[0] * 3, loss_mask=[1] * 3, finish_reason=finish,
            sampling=SamplingSpec(), reward=reward,
        )

    group = Group(
        prompt=Prompt(id="p", token_ids=[1]),
        samples=[sample(0, "stop", 1.0), sample(1, "length", 0.0), sample(2, "stop", 0.5)],
        advantages=[1.0, -1.0, 0.0],  # computed with the cut sample's reward in the group
    )
    batch, stats = build_batch(0, [group], max_lag=0, max_tokens=3, reward_name="r", filter_overlong=True)
    assert [s.loss_mask for s in batch.samples] == [[1, 1, 1], [0, 0, 0], [1, 1, 1]]
    assert [s.advantage for s in batch.samples] == [1.0, -1.0, 0.0] and stats["overlong_filtered"] == 1
    assert stats["reward_mean"] == pytest.approx(0.5)  # its reward still counts
    _, plain = build_batch(0, [group], max_lag=0, max_tokens=3, reward_name="r")
    assert plain["overlong_filtered"] == 0
