"""The controller: wires a run's components, drives them under one TaskGroup, and tears down.

`Controller(...)` checks the config and makes what is light (`setup.prepare`: the task, the
source of episodes, the scorers); `Controller.run` prepares the output directory, starts the
episode source, builds the heavy components (`setup.build`), restores a checkpoint when
resuming, starts the engine, then runs the producer, the training loop, the engine's health
watch and the loop-lag probe together; on completion, error, `request_stop` or cancellation it
accounts for every prompt, writes the final checkpoint and closes everything. Components never
reference the controller: it builds them in `setup` and calls them.
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from rollflow.buffer import Admission, GroupBuffer
from rollflow.checkpoint import RunState
from rollflow.checks import in_flight_samples
from rollflow.closing import CLOSE_TIMEOUT_S, close_within
from rollflow.config import Config, dump_config
from rollflow.controller.accounting import Accounting
from rollflow.controller.persistence import Checkpointer, Outputs, prepare_output_dir
from rollflow.controller.producer import Producer
from rollflow.controller.result import RunResult
from rollflow.controller.setup import Components, Flow, Given, build, prepare
from rollflow.controller.snapshot import Checkpointed, restore, snapshot
from rollflow.controller.stall import StallWatch
from rollflow.controller.supervisor import Supervisor
from rollflow.controller.training import Hooks, TrainingLoop
from rollflow.controller.weights import AdapterWeights, FullWeights, WeightPublisher, WeightStrategy
from rollflow.engine import ManagedEngine
from rollflow.errors import ConfigError
from rollflow.evaluate import HeldOut, HeldOutEpisodes, evaluate_held_out
from rollflow.guest import threads as guest_threads
from rollflow.rundir import OwnedRun
from rollflow.sampler import sampling_spec
from rollflow.scoring import RewardFunc
from rollflow.trainer import TrainerBackend


class Controller:
    """One training run: engine, trainer, transport, sampler, buffer, and the two loops."""

    # ---- set in __init__
    config: Config
    output_dir: Path
    admission: Admission
    buffer: GroupBuffer
    stall: StallWatch
    # ---- set by run() and setup()
    began: float
    outputs: Outputs
    parts: Components
    flow: Flow
    weights: WeightPublisher
    producer: Producer
    checkpointer: Checkpointer
    training: TrainingLoop | None = None
    checkpointed: Checkpointed

    def __init__(
        self,
        config: Config,
        output_dir: str | Path,
        *,
        on_step: Callable[[dict], None] | None = None,
        resume: bool = False,
        reward_funcs: dict[str, RewardFunc] | None = None,
        env: Any = None,
        agent: Any = None,
        given: Given | None = None,
    ):
        """`resume`: continue the run in `output_dir` from its latest checkpoint. `reward_funcs`:
        reward functions by name (TRL signature), added to those configured in
        `[[scoring.rewards]]` (an entry with the same name sets its weight and timeout). `env`:
        makes the `Environment` of each multi-turn episode, `agent`: runs each episode against
        the run's OpenAI-compatible endpoint (default: what `[env]` names; none: single-turn
        samples). `given`: components to use instead of building them from the config (tests
        pass fakes, `rollflow.testing`; the simulator a timed trainer and its virtual clock).
        Settings the run cannot use are refused here, before anything is written."""
        self.plan = prepare(config, reward_funcs=reward_funcs, env=env, agent=agent)
        self.config = self.plan.config
        self.output_dir = Path(output_dir)
        self.on_step = on_step
        self.resume = resume
        self._given = given or Given()
        self.clock = self._given.clock
        run = self.config.run
        self.admission = Admission(run.groups_per_step * self.config.rollout.group_size, run.max_lag)
        self.buffer = GroupBuffer()
        self._stop = asyncio.Event()
        self.stall = StallWatch(
            run.max_dropped_in_a_row or 4 * run.groups_per_step,
            run.stall_timeout_s,
            clock=self.clock,
            on_stall=lambda message: self._stop.set(),
        )
        """The stop rule for a run that cannot learn (its message is the run's error)."""

    # ---- the public surface ------------------------------------------------------------------

    @property
    def stopping(self) -> bool:
        """A stop was requested."""
        return self._stop.is_set()

    def request_stop(self) -> None:
        """Stop after the current step: checkpoint the run with its work in progress and return
        (the CLI calls this on SIGINT / SIGTERM). Safe to call from a signal handler on the loop."""
        self._stop.set()

    @property
    def engine(self) -> ManagedEngine:
        """The engine serving now (a restart replaces it)."""
        return self.flow.supervisor.engine

    @property
    def engine_restarts(self) -> int:
        return self.flow.supervisor.restarts

    @property
    def trainer(self) -> TrainerBackend:
        return self.parts.runner.backend

    # ---- the run -----------------------------------------------------------------------------

    async def run(self) -> RunResult:
        owned = OwnedRun(self.output_dir)  # before anything in the directory is read or cut back
        try:
            resumed = prepare_output_dir(self.output_dir, self.config, resume=self.resume)
            owned.record("running")
            try:
                with guest_threads().serving(in_flight_samples(self.config), on_stuck=self.stall.give_up):
                    result = await self._run(resumed)
            except BaseException as err:
                training = self.training
                steps, last = (training.steps_done, self.checkpointer.last) if training is not None else (0, None)
                if not isinstance(err, asyncio.CancelledError):
                    owned.record("failed", steps, f"{type(err).__name__}: {err}")
                else:  # stopped: a stop whose step did not end in time (the CLI's signals)
                    state = "stopped" if self._stop.is_set() else "failed"
                    owned.record(state, steps, f"cancelled before its step ended; last checkpoint: {last}")
                raise
            owned.record("stopped" if result.stopped else "finished", result.first_step + result.steps)
            return result
        finally:
            owned.release()

    async def _run(self, resumed: tuple[Path, RunState] | None) -> RunResult:
        cfg = self.config
        (self.output_dir / "config.toml").write_text(dump_config(cfg))
        self.began = self.clock()
        self.outputs = out = Outputs(self.output_dir, cfg, self.began)
        try:
            await self._start_episodes()
            out.waiting(f"loading {cfg.model.path} for the trainer")
            await self.setup()
        except BaseException:
            await self._close_episodes()
            out.close()
            raise
        evaluated: dict[str, HeldOut] = {}
        final = None
        frozen = False
        try:
            if resumed is not None:
                await restore(self.checkpointed, *resumed)
            out.waiting("starting the vLLM engine")
            await self.engine.start()
            await self.weights.strategy.prepare(self.engine)
            if cfg.run.eval_prompts and resumed is None:
                evaluated["before"] = await self._evaluate(cfg.run.eval_pass_k)
            if cfg.run.gc_freeze:
                # No gc.collect() first: a full collection of the startup heap costs a fixed
                # 0.1-0.3 s; garbage frozen with the rest is collected after the run unfreezes.
                gc.freeze()
                frozen = True
            await self._drive_and_keep()
            final = await self._finish()
            if cfg.run.eval_prompts and not self._stop.is_set():
                evaluated["after"] = await self._evaluate(cfg.run.eval_pass_k)
        finally:
            if frozen:
                gc.unfreeze()
            await self._teardown()
        self.stall.raise_if_fired(self.checkpointer.last)
        return self._result(evaluated, final)

    async def _drive_and_keep(self) -> None:
        """Drive the run; an error between steps keeps the steps trained since the last checkpoint."""
        try:
            await self._drive()
        except Exception:
            training = self.training
            assert training is not None
            await self.checkpointer.after_error(training.steps_done, training.in_step, self._final_checkpoint)
            raise

    async def _finish(self) -> Path | None:
        """A run that was not stopped: its final checkpoint and its trained model (`final/`)."""
        cfg = self.config
        if self._stop.is_set():
            return None
        if self.checkpointer.enabled:
            await self._final_checkpoint(cfg.run.max_steps)
        if not (cfg.checkpoint.final_model and self.parts.policy_base):
            return None
        self.outputs.waiting("writing the trained model to final/")
        return await self.checkpointer.export_final(self.parts.policy_base, lora=cfg.trainer.lora.enabled)

    def _result(self, evaluated: dict[str, HeldOut], final: Path | None) -> RunResult:
        training, accounting = self.training, self.flow.accounting
        assert training is not None
        before, after = evaluated.get("before"), evaluated.get("after")
        return RunResult(
            steps=len(training.metrics),
            wall_s=self.clock() - self.began,
            metrics=training.metrics,
            trained_prompts=accounting.trained,
            dropped=dict(accounting.dropped),
            eval_before=before.greedy if before else None,
            eval_after=after.greedy if after else None,
            pass_before=before.sampled if before else None,
            pass_after=after.sampled if after else None,
            engine_busy_s=self.producer.engine_busy_s,
            first_step=training.first_step,
            stopped=self._stop.is_set(),
            checkpoint=str(self.checkpointer.last) if self.checkpointer.last else None,
            final_model=str(final) if final else None,
        )

    async def _drive(self) -> None:
        """The producer, the training loop, the health watch and the loop-lag probe, together
        until training ends; the other three are then cancelled."""
        training = self.training
        assert training is not None
        self.stall.stepped()  # the stall clock starts with the run
        try:
            async with asyncio.TaskGroup() as tg:
                producer = tg.create_task(self.producer.run(tg), name="producer")
                probe = tg.create_task(self.outputs.loop_lag.run(), name="loop-lag")
                health = tg.create_task(self.flow.supervisor.watch(), name="engine-health")
                try:
                    await training.run(tg)
                finally:
                    await self.admission.close()
                    for task in (producer, probe, health):
                        task.cancel()
                    self.producer.cancel()
        except ExceptionGroup as group:
            first = group.exceptions[0]
            if all(type(e) is type(first) and str(e) == str(first) for e in group.exceptions):
                raise first from None  # one failure, seen by one or more tasks: raise it plainly
            raise

    # ---- setup and teardown ------------------------------------------------------------------

    async def _start_episodes(self) -> None:
        """Start what the episodes need for the whole run (an OpenEnv server, or check that one
        answers; the agents' endpoint) before anything heavy loads, so a bad address fails in seconds."""
        episodes = self.plan.episodes
        if episodes is not None:
            self.outputs.waiting(f"starting {type(episodes).__name__}")
            await episodes.start()

    async def _close_episodes(self) -> None:
        if self.plan.episodes is not None:
            await self.plan.episodes.aclose()

    async def setup(self) -> None:
        """Build every component and wire them; nothing starts running here."""
        parts = self.parts = await build(self.plan, self._given)
        cfg = self.config = parts.config
        out = self.outputs
        strategy: WeightStrategy = (
            AdapterWeights(parts.runner, cfg.rollout.partial)
            if cfg.trainer.lora.enabled
            else FullWeights(parts.runner, parts.transport, cfg.rollout.partial, engine_dtype=cfg.model.dtype)
        )
        supervisor = Supervisor(
            parts.engine,
            parts.engine_factory,
            prepare=strategy.prepare,
            max_restarts=cfg.engine.max_restarts,
            health_check_s=cfg.engine.health_check_s,
            trace=out.trace,
            clock=self.clock,
        )
        flow = self.flow = Flow(
            self.admission,
            self.buffer,
            Accounting(out.ledger),
            self.stall,
            supervisor,
            out.trace,
            self.clock,
            self._stop,
        )
        self.weights = WeightPublisher(strategy, supervisor, self.admission, trace=out.trace, clock=self.clock)
        self.producer = Producer(cfg, flow, parts, self.plan.scorer, self.plan.episodes, sampling_spec(cfg))
        self.checkpointer = Checkpointer(
            self.output_dir, cfg, parts.runner, logs=[out.ledger, out.metrics], trace=out.trace, clock=self.clock
        )
        hooks = Hooks(
            checkpoint=lambda steps, stopping: self._checkpoint(steps, keep_pending=stopping),
            evaluate=lambda: self._evaluate(cfg.run.eval_pass_k),
            on_step=self.on_step,
        )
        self.training = TrainingLoop(
            cfg, flow, parts.runner, self.producer, self.weights, self.checkpointer, out, hooks
        )
        self.training.began = self.began
        self.checkpointed = Checkpointed(flow, parts.sampler, self.producer, self.training, out, self.checkpointer)

    async def _teardown(self) -> None:
        """Account for every prompt, then close each part under its own bound (`close_within`)."""
        self._settle()
        parts: dict[str, Callable[[], Awaitable[None]]] = {
            "the producer": self.producer.aclose, "the source of episodes": self._close_episodes,
            "the trainer ranks": self.parts.runner.aclose, "the reward scorer": self.plan.scorer.aclose,
            "the held-out scorer": self.plan.eval_scorer.aclose, "the weight transport": self.parts.transport.aclose,
            "the engine": self.flow.supervisor.aclose}  # fmt: skip
        for name, close in parts.items():
            await close_within(name, close, CLOSE_TIMEOUT_S)
        self.outputs.close()

    def _settle(self) -> None:
        """Drop what the run leaves unfinished (unless a checkpoint holds it) and give its
        admission room back: the final checkpoint then counts only samples that were trained."""
        accounting = self.flow.accounting
        accounting.settle(self.buffer, self.producer.take_in_flight(), self.config.rollout.group_size)
        abandoned = accounting.take_abandoned()
        if abandoned:
            self.admission.forget(abandoned)

    # ---- checkpoints and evaluation ------------------------------------------------------------

    async def _final_checkpoint(self, step: int) -> Path:
        self._settle()  # the final checkpoint holds no work in progress
        return await self._checkpoint(step, keep_pending=False)

    async def _checkpoint(self, step: int, *, keep_pending: bool) -> Path:
        """A checkpoint after `step` steps. `keep_pending`: the run is stopping; its buffered and
        in-flight work is saved, then cancelled without being dropped."""
        self.outputs.waiting(f"writing the checkpoint of step {step}")
        training = self.training
        assert training is not None
        state = snapshot(self.checkpointed, step, self.clock() - self.began + training.wall_offset)
        if keep_pending:
            self.flow.accounting.hold_pending()
            await self.admission.close()
            self.producer.cancel()
        return await self.checkpointer.save(state)

    async def _evaluate(self, pass_k: int = 0) -> HeldOut:
        """The held-out scores of the engine's weights: single turns of `data.task` scored with
        `run.reward`, or, when the samples are episodes, held-out episodes scored as training
        scores them."""
        self.outputs.waiting(f"scoring {self.config.run.eval_prompts} held-out prompts")
        episodes, scorer = None, self.plan.eval_scorer
        if self.plan.episodes is not None and self.producer.context is not None:
            episodes = HeldOutEpisodes(self.plan.episodes, self.producer.context, self.parts.held_out_rows)
            scorer = self.plan.scorer
        return await evaluate_held_out(
            self.engine, self.config, self.parts.tokenizer, scorer, pass_k=pass_k, episodes=episodes
        )


async def train(
    config: Config,
    output_dir: str | Path,
    *,
    on_step: Callable[[dict], None] | None = None,
    resume: bool = False,
    reward_funcs: dict[str, RewardFunc] | None = None,
    env: Any = None,
    agent: Any = None,
    environment_factory: Any = None,
) -> RunResult:
    """Run training in the current event loop; writes config.toml, metrics.jsonl, ledger.jsonl
    and checkpoints. `resume`: continue the run in `output_dir` from its latest checkpoint.
    `reward_funcs`: reward functions by name (TRL signature), besides the configured ones.
    `env`: makes each episode's `Environment` (multi-turn), instead of the one `[env]` names.
    `agent`: an OpenAI-API agent runs each episode (`rollflow.agent`), instead of the one
    `[env]` names. `environment_factory`: TRL's environment class (or classes by name) plays
    each episode (`rollflow.envs.factory`), as `GRPOTrainer(environment_factory=...)` takes it."""
    if environment_factory is not None:
        if env is not None:
            raise ConfigError("give env= or environment_factory=, not both")
        from rollflow.envs.factory import EnvironmentFactory

        env = EnvironmentFactory(environment_factory)
    controller = Controller(
        config, output_dir, on_step=on_step, resume=resume, reward_funcs=reward_funcs, env=env, agent=agent
    )
    return await controller.run()
