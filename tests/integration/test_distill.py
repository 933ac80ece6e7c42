"""On-policy distillation with real vLLM on the tiny model: the teacher scores the student's own
tokens, and a teacher equal to the student gives zero reverse-KL advantages."""

from __future__ import annotations

import pytest

import rollflow
from rollflow.controller.setup import Given

pytestmark = pytest.mark.integration


def zero(prompts, completions, **kwargs):
    """No reward signal at all: the teacher's is the only one."""
    return [0.0] * len(completions)


async def test_a_teacher_equal_to_the_student_gives_zero_reverse_kl_advantages(tmp_path, tiny_preset_engine):
    config = rollflow.load_config(
        preset="tiny",
        overrides=["run.max_steps=1", "run.max_lag=0", "scoring.teacher=tiny", "observe.sinks=[]",
                   "sampling.temperature=0.8", "sampling.top_k=20"],
    )
    result = await rollflow.Controller(
        config,
        tmp_path,
        reward_funcs={"zero": zero},
        given=Given(engine=await tiny_preset_engine()),
    ).run()
    (row,) = result.metrics
    # Same weights: the teacher's log-probs are the engine's own (float32, same support).
    assert row["tokens"] > 0 and abs(row["teacher_kl"]) < 1e-4 and row["teacher_gap_abs_max"] < 1e-3


@pytest.mark.timeout(600)
async def test_the_students_kl_to_a_different_teacher_falls(tmp_path, tiny_preset_engine):
    # Teacher: the tiny model of another seed; no task reward. 16 steps of 1,024 sampled tokens.
    config = rollflow.load_config(
        preset="tiny",
        overrides=["run.max_steps=16", "run.max_lag=0", "run.groups_per_step=16", "scoring.teacher=tiny:1",
                   "trainer.lr=3e-3", "observe.sinks=[]"],
    )
    result = await rollflow.Controller(
        config,
        tmp_path,
        reward_funcs={"zero": zero},
        given=Given(engine=await tiny_preset_engine()),
    ).run()
    kl = [row["teacher_kl"] for row in result.metrics]
    early, late = sum(kl[:4]) / 4, sum(kl[-4:]) / 4
    # Measured here: 6.92 -> 6.35 (per-step noise about 0.15).
    assert late < early - 0.2, f"teacher KL did not fall: {[round(k, 2) for k in kl]}"
