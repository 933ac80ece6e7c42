"""The training loop: groups -> batch -> trainer step -> publish weights -> ledger, metrics, checkpoint.

Each iteration takes `run.groups_per_step` groups from the buffer (or stops when asked), builds
the batch (tokens too stale for `max_lag` withheld), steps the trainer on its thread while the
event loop keeps streaming, hands the new weights to the engine (which loads them while the
next step trains), writes the step's ledger lines and metrics, and checkpoints when one is due.
Consecutive non-finite steps end the run with the last good weights saved. What each stage does
lives in its component; this module only says in what order they happen.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from rollflow import faults
from rollflow.batch import build_batch
from rollflow.config import Config
from rollflow.controller.persistence import Checkpointer, Outputs
from rollflow.controller.producer import Producer
from rollflow.controller.setup import Flow
from rollflow.controller.step_metrics import TRAINER_KEYS, StepMetrics
from rollflow.controller.trainer_thread import TrainerRunner
from rollflow.controller.weights import WeightPublisher
from rollflow.errors import TrainingError
from rollflow.evaluate import HeldOut
from rollflow.records import Group
from rollflow.trainer.batches import model_tokens


@dataclass(frozen=True)
class Hooks:
    """What the training loop calls back into: writing a checkpoint after n steps (True: the
    run stops, its pending work is saved), scoring the held-out prompts on the engine (every
    `run.eval_every` steps), and the caller's `on_step` with each step's metrics."""

    checkpoint: Callable[[int, bool], Awaitable[Path]]
    evaluate: Callable[[], Awaitable[HeldOut]] | None = None
    on_step: Callable[[dict], None] | None = None


class TrainingLoop:
    """Consumes the buffer one optimizer step at a time."""

    def __init__(
        self,
        config: Config,
        flow: Flow,
        runner: TrainerRunner,
        producer: Producer,
        publisher: WeightPublisher,
        checkpointer: Checkpointer,
        outputs: Outputs,
        hooks: Hooks,
    ) -> None:
        self.config = config
        self.flow = flow
        self.runner = runner
        self.producer = producer
        self.publisher = publisher
        self.checkpointer = checkpointer
        self.outputs = outputs
        self.hooks = hooks
        self.metrics: list[dict[str, Any]] = []
        """Every step's row, as the sinks got it."""
        self.first_step = 0
        """The step this run starts at (> 0 when resumed)."""
        self.wall_offset = 0.0
        """Wall time of the run's earlier parts (resumed runs)."""
        self.began = 0.0
        self.nonfinite_streak = 0
        """Steps in a row skipped for a non-finite loss or gradient."""
        self.in_step = False
        """Between taking a step's groups and recording them: the trainer's weights may be ahead
        of the step count (a checkpoint then would not match them)."""

    @property
    def steps_done(self) -> int:
        return self.metrics[-1]["step"] + 1 if self.metrics else self.first_step

    async def run(self, tg: asyncio.TaskGroup) -> None:
        run = self.config.run
        for step in range(self.first_step, run.max_steps):
            t0 = self.flow.clock()
            before = (self.producer.generated_tokens, self.producer.busy_total(), self.producer.filtered)
            groups = await self._take_or_stop(run.groups_per_step)
            if groups is None:
                break
            self.flow.accounting.stepping = groups  # out of the buffer, not yet in the ledger
            self.in_step = True
            t_batch = self.flow.clock()
            batch, stats = self._batch(step, groups)
            trained = await self.runner.step(batch) if batch.samples else {}
            self.runner.steps_run = step + 1  # also for an empty batch: its version is published all the same
            t_step = self.flow.clock()
            self._trace_step(step, t_batch, t_step, stats["samples"])
            faults.point("step-trained")
            staged = await self.publisher.publish(tg, step + 1)
            t_sync = self.flow.clock()
            self.outputs.trace.span("stage weights", "weight sync", t_step, t_sync, step=step, bytes=staged)
            skipped = bool(trained.get("skipped"))
            self.flow.accounting.record_step(step, groups, skipped=skipped)
            self.in_step = False
            self.flow.stall.stepped()
            self.nonfinite_streak = self.nonfinite_streak + 1 if skipped else 0
            evaluated = await self._evaluate_if_due(step + 1)
            if evaluated:
                self.flow.stall.restart_clock()
            self._report(step, (t0, t_batch, t_step, t_sync), before, stats, trained, staged, evaluated)
            await self._stop_if_diverged(step)
            if self.flow.stop.is_set():
                break
            if self.checkpointer.due(step + 1):
                await self.hooks.checkpoint(step + 1, False)
                self.flow.stall.restart_clock()
        if self.flow.stop.is_set():
            if self.checkpointer.enabled:
                await self.hooks.checkpoint(self.steps_done, True)
            return
        await self.flow.admission.close()  # no step is left to consume new samples
        await self.publisher.drain()  # the last step's weights are in the engine when the run returns

    async def _evaluate_if_due(self, version: int) -> dict[str, float]:
        """Every `run.eval_every` steps: the held-out scores of `version`'s weights, measured once
        the engine serves them; generation goes on meanwhile, the next step waits."""
        every = self.config.run.eval_every
        if self.hooks.evaluate is None or not every or version % every or version >= self.config.run.max_steps:
            return {}  # (the last step's weights are scored after the run)
        began = self.flow.clock()
        await self.publisher.drain()
        held_out = await self.hooks.evaluate()
        self.outputs.trace.span("evaluate", "engine", began, self.flow.clock(), version=version)
        out = {"eval_accuracy": held_out.greedy.accuracy, "eval_s": self.flow.clock() - began}
        if held_out.greedy.versions:
            out["eval_version"] = min(held_out.greedy.versions)
        if held_out.sampled is not None:
            out["eval_pass_at_k"] = held_out.sampled.pass_at_group
        return out

    async def _take_or_stop(self, n: int) -> list[Group] | None:
        """The next `n` groups, or None if a stop is requested first."""
        if self.flow.stop.is_set():
            return None
        take = asyncio.ensure_future(self.flow.buffer.take(n))
        stop = asyncio.ensure_future(self.flow.stop.wait())
        try:
            await asyncio.wait({take, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
            if not take.done():
                take.cancel()
            await asyncio.gather(take, stop, return_exceptions=True)
        return take.result() if not take.cancelled() else None

    def _batch(self, step: int, groups: list[Group]) -> tuple[Any, dict[str, Any]]:
        cfg = self.config
        batch, stats = build_batch(
            step,
            groups,
            max_lag=cfg.run.max_lag,
            max_tokens=cfg.completion_budget,
            reward_name=cfg.run.reward,
            distill_coef=cfg.scoring.distill_coef,
            filter_overlong=cfg.rollout.overlong == "filter",
        )
        trainer = cfg.trainer
        stats["model_tokens"] = model_tokens(batch.samples, trainer.micro_batch_tokens, trainer.layout)
        return batch, stats

    def _trace_step(self, step: int, began: float, ended: float, samples: int) -> None:
        self.outputs.trace.span("train step", "trainer", began, ended, step=step, samples=samples)
        for i, (start, end, n_samples, n_tokens) in enumerate(self.runner.backend.micro_batches):
            self.outputs.trace.span(
                "micro-batch", "trainer", start, end, step=step, index=i, samples=n_samples, tokens=n_tokens
            )

    def _report(
        self,
        step: int,
        times: tuple[float, float, float, float],
        before: tuple[int, float, int],
        stats: dict[str, Any],
        trained: dict[str, float],
        staged: int,
        evaluated: dict[str, float],
    ) -> None:
        """The step's metrics to every sink, `metrics` and `on_step`."""
        t0, t_batch, t_step, t_sync = times
        interval = t_sync - t0

        def per_s(amount: float) -> float:
            return amount / interval if interval > 0 else 0.0

        busy = self.producer.busy_total()
        row = msgspec.convert(
            {
                **stats,
                **{k: v for k, v in trained.items() if k in TRAINER_KEYS},
                "step": step,
                "version": step + 1,
                "loss_tokens": trained.get("tokens", 0.0),
                "trainer_idle_frac": per_s(t_batch - t0),
                "engine_idle_frac": max(0.0, 1.0 - per_s(busy - before[1])),
                "gen_tokens_per_s": per_s(self.producer.generated_tokens - before[0]),
                "trained_tokens_per_s": per_s(stats["tokens"]),
                "samples_per_s": per_s(stats["samples"]),
                "batch_wait_s": t_batch - t0,
                "train_step_s": t_step - t_batch,
                "weight_sync_s": t_sync - t_step,
                "weight_sync_bytes": staged,
                "engine_update_s": self.publisher.last_update_s,
                "buffer_groups": len(self.flow.buffer),
                "engine_busy_s": busy,
                "engine_restarts": self.flow.supervisor.restarts,
                "filtered_groups": self.producer.filtered - before[2],
                **self.outputs.loop_lag.take(),
                "wall_s": t_sync - self.began + self.wall_offset,
                **evaluated,
            },
            StepMetrics,
        ).as_row()
        self.metrics.append(row)
        for sink in self.outputs.sinks:
            sink.write(row)
        if self.hooks.on_step is not None:
            self.hooks.on_step(row)

    async def _stop_if_diverged(self, step: int) -> None:
        """Too many non-finite steps in a row end the run, with the last good weights saved."""
        if self.nonfinite_streak < self.config.checkpoint.max_nonfinite_steps:
            return
        where = "checkpoints are off (checkpoint.enabled = false)"
        if self.checkpointer.enabled:
            saved = await self.hooks.checkpoint(step + 1, True)
            where = f"the last good weights and all pending work are in {saved}; resume with --resume"
        raise TrainingError(
            f"{self.nonfinite_streak} steps in a row had a non-finite loss or gradient (last: step {step}); "
            f"stopping: {where}. Lower trainer.lr or check the rewards first"
        )
