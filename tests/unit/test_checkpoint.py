"""Checkpoints and resume with a fake engine and trainer: atomic writes, exact prompt accounting,
in-flight samples continued token-exactly, non-finite steps."""

from __future__ import annotations

import asyncio
import errno
import json

import pytest

from rollflow.checkpoint import PendingGroup, RunState, checkpoints, latest_checkpoint, read_state, save_checkpoint
from rollflow.config import load_config
from rollflow.controller import Controller
from rollflow.controller.setup import Given
from rollflow.errors import CheckpointError, TrainingError, UserInputError
from rollflow.ledger import summarize
from rollflow.testing import (
    FakeEngine,
    FakeTokenizer,
    FakeTrainer,
    NullTransport,
)

MAX_TOKENS = 24


def make(tmp_path, *, resume=False, on_step=None, trainer=None, **settings):
    overrides = ["run.reward=digits", f"sampling.max_tokens={MAX_TOKENS}", "observe.sinks=[]", "run.max_steps=6"]
    overrides += [f"{key.replace('__', '.')}={value}" for key, value in settings.items()]
    return Controller(
        load_config(preset="tiny", overrides=overrides),
        tmp_path,
        on_step=on_step,
        resume=resume,
        given=Given(
            engine=FakeEngine(token_delay=0.002),
            trainer=trainer or FakeTrainer(step_s=0.05),
            transport=NullTransport(),
            tokenizer=FakeTokenizer(),
        ),
    )


def jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


async def test_a_stop_saves_work_in_flight_and_resume_continues_it_exactly(
    tmp_path, record_groups, assert_versions_exact
):
    first = make(tmp_path, on_step=lambda row: row["step"] == 1 and first.request_stop())
    result = await asyncio.wait_for(first.run(), 60)
    assert result.stopped and result.steps == 2
    state = read_state(latest_checkpoint(tmp_path))
    assert state.step == 2
    assert not [e for e in jsonl(tmp_path / "ledger.jsonl") if e["outcome"] == "dropped"]  # nothing given up
    partial = {
        (group.prompt.id, i): sample
        for group in state.in_flight
        for i, sample in enumerate(group.samples)
        if sample.done is None and 0 < len(sample.tokens) < MAX_TOKENS
    }
    assert partial, "the checkpoint should hold samples stopped mid-generation"
    assert all(len(s.versions) == len(s.tokens) == len(s.logprobs) for s in partial.values())

    trained_groups = record_groups
    resumed = await asyncio.wait_for(make(tmp_path, resume=True).run(), 60)
    assert resumed.first_step == 2 and not resumed.stopped
    metrics = jsonl(tmp_path / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(6))
    # Staleness stays bounded across the resume: no token in the loss lags more than max_lag (1).
    assert all(m["loss_lag_max"] <= 1 for m in metrics) and max(m["lag_max"] for m in metrics[2:]) <= 2
    continued = 0
    for group in trained_groups:
        for i, sample in enumerate(group.samples):
            saved = partial.get((group.prompt.id, i))
            assert_versions_exact(
                sample.prompt_token_ids, sample.completion_token_ids, sample.versions
            )
            if saved is None:
                continue
            k = len(saved.tokens)
            assert sample.completion_token_ids[:k] == saved.tokens
            assert sample.versions[:k] == saved.versions and max(saved.versions) <= 2
            assert len(sample.completion_token_ids) > k and min(sample.versions[k:]) >= 2
            continued += 1
    assert continued == len(partial)  # every saved partial sample was continued and trained
    summary = summarize(tmp_path)
    assert summary.ok and summary.missing == [] and summary.duplicates == []
    assert summary.trained + sum(summary.dropped.values()) == len(read_state(latest_checkpoint(tmp_path)).consumed)


async def test_an_error_between_steps_checkpoints_and_resumes_without_losing_or_repeating_prompts(tmp_path):
    def crash(row):
        if row["step"] == 3:
            raise RuntimeError("simulated crash")

    with pytest.raises(RuntimeError, match="simulated crash"):
        await asyncio.wait_for(make(tmp_path, on_step=crash, checkpoint__every=3).run(), 60)
    # The error came between steps: the four steps trained are saved (not only the periodic
    # checkpoint of step 3), and the run is marked failed.
    assert read_state(latest_checkpoint(tmp_path)).step == 4
    summary = summarize(tmp_path)
    assert not summary.ok and summary.run.startswith("failed after 4 steps: RuntimeError: simulated crash")
    assert summary.missing == [] and summary.duplicates == []
    result = await asyncio.wait_for(make(tmp_path, resume=True, checkpoint__every=3).run(), 60)
    assert result.first_step == 4 and result.steps == 2
    entries = jsonl(tmp_path / "ledger.jsonl")
    assert sorted(e["step"] for e in entries if e["outcome"] == "trained") == sorted(list(range(6)) * 4)
    assert [m["step"] for m in jsonl(tmp_path / "metrics.jsonl")] == list(range(6))
    summary = summarize(tmp_path)
    assert summary.ok and summary.missing == [] and summary.pending == 0


async def test_resume_needs_a_checkpoint_and_steps_left(tmp_path):
    with pytest.raises(UserInputError, match="no checkpoint to resume from"):
        await make(tmp_path, resume=True).run()
    await asyncio.wait_for(make(tmp_path, run__max_steps=2).run(), 60)
    with pytest.raises(UserInputError, match="already did 2 steps"):
        await make(tmp_path, resume=True, run__max_steps=2).run()
    result = await asyncio.wait_for(make(tmp_path, resume=True, run__max_steps=3).run(), 60)
    assert result.first_step == 2 and result.steps == 1


async def test_a_finished_run_resumed_for_more_steps_keeps_generating_ahead(tmp_path):
    """The groups a finished run leaves unfinished are dropped and give their admission room back:
    the final checkpoint counts only trained samples, and the resumed steps overlap generation
    with training (lag > 0 appears with max_lag 2) as the first run's did."""
    first = await asyncio.wait_for(make(tmp_path, run__max_steps=4, run__max_lag=2).run(), 60)
    samples_per_step = 4 * 4
    assert max(m["lag_max"] for m in first.metrics) > 0
    assert read_state(latest_checkpoint(tmp_path)).started == 4 * samples_per_step
    resumed = await asyncio.wait_for(make(tmp_path, resume=True, run__max_steps=8, run__max_lag=2).run(), 60)
    assert resumed.first_step == 4 and resumed.steps == 4
    assert max(m["lag_max"] for m in resumed.metrics) > 0
    summary = summarize(tmp_path)
    assert summary.ok and summary.missing == [] and summary.duplicates == []


async def test_resume_refuses_changed_settings_the_checkpoint_depends_on(tmp_path):
    await asyncio.wait_for(make(tmp_path, run__max_steps=2).run(), 60)
    saved = (tmp_path / "config.toml").read_text()
    for setting, expected in [
        ({"run__groups_per_step": 8}, "run.groups_per_step: 4 -> 8"),
        ({"rollout__group_size": 2}, "rollout.group_size: 4 -> 2"),
        ({"data__seed": 7}, "data.seed: 0 -> 7"),
        ({"model__path": "tiny:1"}, "model.path: 'tiny' -> 'tiny:1'"),
        ({"trainer__lora__enabled": "true"}, "trainer.lora.enabled: False -> True"),
    ]:
        with pytest.raises(UserInputError, match="cannot resume") as caught:
            await make(tmp_path, resume=True, run__max_steps=3, **setting).run()
        assert str(tmp_path / "config.toml") in str(caught.value) and expected in str(caught.value)
        assert (tmp_path / "config.toml").read_text() == saved  # the refused resume changed nothing
    # Settings the checkpoint does not depend on may change.
    resumed = make(tmp_path, resume=True, run__max_steps=3, trainer__lr=1e-4, run__max_lag=2)
    result = await asyncio.wait_for(resumed.run(), 60)
    assert result.first_step == 2 and result.steps == 1


class _NonFinite(FakeTrainer):
    def step(self, batch):
        return {**super().step(batch), "skipped": 1.0}


async def test_repeated_non_finite_steps_stop_the_run_with_a_checkpoint(tmp_path):
    controller = make(tmp_path, trainer=_NonFinite(), checkpoint__max_nonfinite_steps=3)
    with pytest.raises(TrainingError, match="3 steps in a row.*resume with --resume"):
        await asyncio.wait_for(controller.run(), 60)
    dropped = [e for e in jsonl(tmp_path / "ledger.jsonl") if e["outcome"] == "dropped"]
    assert len(dropped) == 3 * 4 and all(e["reason"].startswith("non-finite loss") for e in dropped)
    state = read_state(latest_checkpoint(tmp_path))
    assert state.step == 3 and state.nonfinite_streak == 3 and (state.in_flight or state.buffer)
    summary = summarize(tmp_path)
    assert summary.missing == [] and summary.duplicates == []
    assert not summary.ok and summary.run.startswith("failed after 3 steps: TrainingError: 3 steps in a row")


def _state(step: int) -> RunState:
    return RunState(
        step=step, wall_s=0.0, trainer={}, rng={}, sampler={}, consumed=[], group_seq=0, started=0, trained=0,
        dropped={}, in_flight=[PendingGroup(prompt=_prompt(), group_id="g0", samples=[])],
    )


def _prompt():
    from rollflow.records import Prompt

    return Prompt(id="p", token_ids=[1, 2])


def test_checkpoints_are_atomic_kept_last_and_a_failed_write_keeps_the_previous(tmp_path):
    def tensors(path):
        path.mkdir()
        (path / "weights").write_bytes(b"w" * 1000)
        return {"steps": 1}

    for step in (1, 2, 2, 3):
        save_checkpoint(tmp_path, _state(step), tensors, step=step, keep_last=2)
    assert [p.name for p in checkpoints(tmp_path)] == ["step-000002-01", "step-000003-00"]
    before = {p: p.read_bytes() for p in latest_checkpoint(tmp_path).rglob("*") if p.is_file()}

    def disk_full(path):
        path.mkdir()
        (path / "weights").write_bytes(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(CheckpointError, match="No space left on device.*step-000003-00 is intact"):
        save_checkpoint(tmp_path, _state(4), disk_full, step=4, keep_last=2)
    assert {p: p.read_bytes() for p in latest_checkpoint(tmp_path).rglob("*") if p.is_file()} == before
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-000002-01", "step-000003-00"]
    assert read_state(latest_checkpoint(tmp_path)).trainer == {"steps": 1}
