"""The controller's admission and staleness rules with a fake engine, trainer and transport."""

from __future__ import annotations

import asyncio
import gc
import itertools
import json
import os
import threading
import time

import msgspec
import pytest

from rollflow.buffer import Admission, lags, withhold_stale
from rollflow.controller import Controller
from rollflow.controller.setup import Given
from rollflow.errors import TrainingError
from rollflow.testing import FakeEngine, FakeTokenizer, FakeTrainer, NullTransport


def test_admission_capacity_rule():
    admission = Admission(samples_per_step=8, max_lag=1)
    assert admission.capacity() == 16 and admission.can_start(16) and not admission.can_start(17)
    assert Admission(8, 0).capacity() == 8
    assert admission.capacity(version=3) == 40


def test_lags_and_withholding():
    assert lags([0, 0, 1, 2], consuming_step=2) == [2, 2, 1, 0]
    mask, withheld = withhold_stale([0, 0, 1, 2], [1, 0, 1, 1], consuming_step=2, max_lag=1)
    assert mask == [0, 0, 1, 1] and withheld == 1  # the already-masked token is not counted


@pytest.mark.timeout(60)
async def test_synchronous_mode_trains_only_lag_zero_tokens(tmp_path, run_fake):
    result, trainer, ledger, _ = await run_fake(tmp_path, FakeEngine(token_delay=0.001), max_lag=0, max_steps=4)
    assert result.steps == 4
    for _step, batch in enumerate(trainer.batches):
        for sample in batch.samples:
            assert sample.loss_mask == [1] * sample.num_completion
        assert all(m["lag_max"] == 0 for m in result.metrics)
    assert all(m["withheld_tokens"] == 0 for m in result.metrics)
    trained = [e for e in ledger if e["outcome"] == "trained"]
    assert len(trained) == 4 * 4 and result.trained_prompts == 16
    # Synchronous: nothing beyond the current step was ever started, so nothing is left over.
    assert [e for e in ledger if e["outcome"] == "dropped"] == []


@pytest.mark.timeout(60)
async def test_async_mode_respects_the_bound_and_accounts_every_prompt(tmp_path, run_fake):
    engine = FakeEngine(token_delay=0.002)
    result, _trainer, ledger, controller = await run_fake(
        tmp_path, engine, FakeTrainer(step_s=0.05), max_lag=2, max_steps=6
    )
    assert max(m["loss_lag_max"] for m in result.metrics) <= 2
    assert max(m["lag_max"] for m in result.metrics) >= 1  # asynchrony actually happened
    ids = [e["id"] for e in ledger]
    assert len(ids) == len(set(ids))  # exactly once
    assert len(ids) == controller.producer.group_seq  # every started prompt is in the ledger
    assert controller.admission.started <= controller.admission.capacity(engine.version)
    assert {e["reason"].split(":")[0] for e in ledger if e["outcome"] == "dropped"} <= {"run ended"}


@pytest.mark.timeout(60)
async def test_stragglers_past_the_bound_are_withheld_not_dropped(tmp_path, run_fake):
    # Every third prompt is a straggler: its group decodes 80 tokens slowly while short groups
    # keep the trainer stepping, so its early tokens outlive max_lag by the time it is consumed.
    def length(prompt):
        return 80 if sum(prompt) % 3 == 0 else 3

    engine = FakeEngine(token_delay=0.004, length_fn=length)
    result, trainer, _ledger, _ = await run_fake(
        tmp_path, engine, FakeTrainer(step_s=0.03), max_lag=1, max_steps=12, max_tokens=100,
    )
    assert all(m["loss_lag_max"] <= 1 for m in result.metrics)
    assert sum(m["withheld_tokens"] for m in result.metrics) > 0
    assert max(m["lag_max"] for m in result.metrics) > 1
    # Withheld tokens leave the loss, but the sample (and its reward) stays in the batch.
    masked = [s for b in trainer.batches for s in b.samples if 0 in s.loss_mask]
    assert masked and all(len(s.loss_mask) == s.num_completion for s in masked)


@pytest.mark.timeout(60)
async def test_cancelling_a_run_mid_step_still_accounts_every_started_prompt(tmp_path, tiny_config):
    engine = FakeEngine(token_delay=0.001)
    controller = Controller(
        tiny_config(max_steps=1000, max_lag=1),
        tmp_path,
        given=Given(
            engine=engine,
            trainer=FakeTrainer(step_s=0.05),
            transport=NullTransport(),
            tokenizer=FakeTokenizer(),
        ),
    )
    task = asyncio.create_task(controller.run())
    while getattr(controller, "flow", None) is None or controller.flow.accounting.trained < 12:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.02)  # most likely inside a trainer step now
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    entries = [json.loads(line) for line in (tmp_path / "ledger.jsonl").read_text().splitlines()]
    ids = [e["id"] for e in entries]
    assert len(ids) == len(set(ids))
    assert len(ids) == controller.producer.group_seq  # every started prompt, once
    assert engine.num_live == 0  # every in-flight request was aborted


async def test_an_output_directory_with_a_run_is_refused(tmp_path, tiny_config):
    from rollflow.errors import UserInputError

    (tmp_path / "ledger.jsonl").write_text('{"id": "x", "outcome": "trained", "step": 0}\n')
    controller = Controller(
        tiny_config(),
        tmp_path,
        given=Given(engine=FakeEngine(), trainer=FakeTrainer(), transport=NullTransport(), tokenizer=FakeTokenizer()),
    )
    with pytest.raises(UserInputError, match="already holds a run"):
        await controller.run()
    assert (tmp_path / "ledger.jsonl").read_text().count("\n") == 1  # untouched


class _SlowLoad(NullTransport):
    """Loading into the engine takes `load_s`; records when each load ran."""

    def __init__(self, load_s: float) -> None:
        self.load_s = load_s
        self.loads: list[tuple[float, float]] = []

    async def load(self, engine, plan) -> None:
        began = time.monotonic()
        await asyncio.sleep(self.load_s)
        self.loads.append((began, time.monotonic()))


class _TimedTrainer(FakeTrainer):
    """Records when each step ran, on which thread, bound to which cores."""

    def __init__(self, step_s: float) -> None:
        super().__init__(step_s)
        self.steps: list[tuple[float, float]] = []
        self.threads: set[int] = set()
        self.cpus: list[set[int]] = []

    def step(self, batch):
        began = time.monotonic()
        self.threads.add(threading.get_native_id())
        if hasattr(os, "sched_getaffinity"):
            self.cpus.append(os.sched_getaffinity(0))
        try:
            return super().step(batch)
        finally:
            self.steps.append((began, time.monotonic()))


@pytest.mark.timeout(60)
async def test_next_step_trains_while_the_engine_loads_the_last_weights(tmp_path, tiny_config):
    engine, trainer, transport = FakeEngine(token_delay=0.0005), _TimedTrainer(step_s=0.05), _SlowLoad(0.3)
    controller = Controller(
        tiny_config(max_lag=2, max_steps=4),
        tmp_path,
        given=Given(engine=engine, trainer=trainer, transport=transport, tokenizer=FakeTokenizer()),
    )
    result = await asyncio.wait_for(controller.run(), 60)
    assert result.steps == 4 and engine.version == 4  # every step's weights reached the engine
    assert len(transport.loads) == 4
    # Step k+1 ran while the engine was still loading step k's weights...
    pairs = zip(trainer.steps[1:], transport.loads, strict=False)
    overlapped = [step for step, load in pairs if step[0] < load[1] and load[0] < step[1]]
    assert overlapped, (trainer.steps, transport.loads)
    # ...and the loads never ran two at a time (the staging area is reused).
    for (_, ended), (began, _) in itertools.pairwise(transport.loads):
        assert began >= ended
    assert all(m["loss_lag_max"] <= 2 for m in result.metrics)
    assert max(m["engine_update_s"] for m in result.metrics) >= 0.3


@pytest.mark.timeout(60)
async def test_trainer_steps_run_on_one_thread_bound_to_trainer_cpus(tmp_path, run_fake):
    if not hasattr(os, "sched_getaffinity"):
        pytest.skip("CPU affinity is Linux-only")
    core = min(os.sched_getaffinity(0))
    trainer = _TimedTrainer(step_s=0.0)
    await run_fake(tmp_path, FakeEngine(), trainer, max_steps=3, trainer_cpus=f"[{core}]")
    assert len(trainer.threads) == 1 and threading.get_native_id() not in trainer.threads
    assert trainer.cpus == [{core}] * 3


class _FreezeProbe(FakeTrainer):
    def step(self, batch):
        self.frozen.append(gc.get_freeze_count())
        return super().step(batch)


@pytest.mark.parametrize("enabled", [True, False])
async def test_startup_objects_are_kept_out_of_the_collector_while_the_run_trains(tmp_path, enabled, run_fake):
    assert gc.get_freeze_count() == 0
    trainer = _FreezeProbe()
    trainer.frozen = []
    await run_fake(tmp_path, FakeEngine(), trainer, max_steps=2, gc_freeze=str(enabled).lower())
    # Frozen during every step (the libraries imported by then number in the thousands at least).
    assert len(trainer.frozen) == 2 and all((n > 1000) if enabled else (n == 0) for n in trainer.frozen)
    assert gc.get_freeze_count() == 0  # undone when the run ends


@pytest.mark.timeout(60)
async def test_groups_with_equal_rewards_are_filtered_and_replaced(tmp_path, tiny_config, record_groups):
    """Dynamic sampling: a group whose rewards are all equal is dropped as filtered, its room goes
    back at once, every batch stays full of groups with a signal, and the ledger audits clean."""
    from rollflow.ledger import summarize

    def half_constant(prompts, completions, **kwargs):  # the prompts of odd length teach nothing
        if len(prompts[0]) % 2:
            return [0.5] * len(completions)
        return [float(i % 2) for i in range(len(completions))]

    config = tiny_config(max_steps=4)
    config = msgspec.structs.replace(config, rollout=msgspec.structs.replace(config.rollout, filter_equal_rewards=True))
    controller = Controller(
        config,
        tmp_path,
        reward_funcs={"half_constant": half_constant},
        given=Given(engine=FakeEngine(), trainer=FakeTrainer(), transport=NullTransport(), tokenizer=FakeTokenizer()),
    )
    result = await asyncio.wait_for(controller.run(), 60)
    assert result.steps == 4 and all(m["samples"] == 16 for m in result.metrics)  # every batch full
    assert all(len({s.reward for s in g.samples}) > 1 for g in record_groups)
    ledger = [json.loads(line) for line in (tmp_path / "ledger.jsonl").read_text().splitlines()]
    filtered = [e for e in ledger if e.get("reason") == "filtered: equal rewards"]
    assert filtered and 0 < sum(m["filtered_groups"] for m in result.metrics) <= len(filtered)
    assert result.dropped.get("filtered") == len(filtered)
    audit = summarize(tmp_path)
    assert audit.ok, audit.format()


@pytest.mark.timeout(60)
async def test_a_run_whose_every_group_is_filtered_stops_at_the_stall_timeout(tmp_path, tiny_config):
    """A policy that has solved (or given up on) every prompt gives groups of equal rewards only:
    dynamic sampling filters them all and no step comes. Filtered groups are not failures, but
    the stop rule's time limit ends such a run, naming them, instead of sampling forever."""

    def constant(prompts, completions, **kwargs):
        return [1.0] * len(completions)

    config = tiny_config(max_steps=4, stall_timeout_s=1)
    config = msgspec.structs.replace(config, rollout=msgspec.structs.replace(config.rollout, filter_equal_rewards=True))
    controller = Controller(
        config,
        tmp_path,
        reward_funcs={"constant": constant},
        given=Given(engine=FakeEngine(), trainer=FakeTrainer(), transport=NullTransport(), tokenizer=FakeTokenizer()),
    )
    with pytest.raises(TrainingError, match=r"no step for \d+ s \(run.stall_timeout_s\).*filtered: equal rewards ×"):
        await asyncio.wait_for(controller.run(), 30)


@pytest.mark.timeout(60)
async def test_soft_overlong_penalty_is_added_to_each_reward_as_a_part(tmp_path, tiny_config, record_groups):
    from rollflow.advantage import overlong_penalty

    config = tiny_config(max_tokens=12, max_steps=2)
    rollout = msgspec.structs.replace(config.rollout, overlong="soft", overlong_buffer=6)
    controller = Controller(
        msgspec.structs.replace(config, rollout=rollout),
        tmp_path,
        given=Given(engine=FakeEngine(), trainer=FakeTrainer(), transport=NullTransport(), tokenizer=FakeTokenizer()),
    )
    result = await asyncio.wait_for(controller.run(), 60)
    samples = [s for g in record_groups for s in g.samples if s.reward is not None]
    assert any(s.reward_parts["overlong"] < 0 for s in samples)
    for s in samples:
        assert s.reward_parts["overlong"] == overlong_penalty(s.num_tokens, 12, 6)
        assert s.reward == pytest.approx(s.reward_parts["digits"] + s.reward_parts["overlong"])
    assert all("overlong" in m["rewards"] for m in result.metrics)
