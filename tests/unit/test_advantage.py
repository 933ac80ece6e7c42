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
