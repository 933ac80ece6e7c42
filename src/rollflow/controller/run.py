"""The controller: wires a run's components, drives them under one TaskGroup, and tears down.

`Controller.run` prepares the output directory, builds the components (`setup.build`), restores
a checkpoint when resuming, starts the engine, then runs the producer, the training loop, the
engine's health watch and the loop-lag probe together; on completion, error, `request_stop` or
cancellation it accounts for every prompt, writes the final checkpoint and closes everything.
Components never reference the controller: it builds them in `setup` and calls them.
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rollflow.agent import Agent, PromptSource, agent_source
from rollflow.buffer import Admission, GroupBuffer
from rollflow.checkpoint import RunState
from rollflow.checks import check_task, check_training
from rollflow.config import Config, dump_config
from rollflow.controller.accounting import Accounting
from rollflow.controller.persistence import Checkpointer, Outputs, prepare_output_dir
from rollflow.controller.producer import Producer
from rollflow.controller.result import RunResult
from rollflow.controller.setup import Components, Given, build
from rollflow.controller.snapshot import Snapshots
from rollflow.controller.stall import StallWatch
from rollflow.controller.supervisor import Supervisor
from rollflow.controller.trainer_thread import TrainerRunner
from rollflow.controller.training import TrainingLoop
from rollflow.controller.weights import AdapterWeights, FullWeights, WeightPublisher, WeightStrategy
from rollflow.engine import ManagedEngine
from rollflow.engine.factory import check_engines
from rollflow.envs import EnvFactory, Served, environment_source
from rollflow.evaluate import HeldOut, evaluate_held_out, sampling_spec
from rollflow.rundir import OwnedRun
from rollflow.scoring import RewardFunc, Scorer, eval_scorer, make_rewards
from rollflow.trace import Trace
from rollflow.trainer import TrainerBackend
from rollflow.weight_sync import WeightTransport


class Controller(Snapshots):
    """One training run: engine, trainer, transport, sampler, buffer, and the two loops."""

    # ---- set in __init__
    config: Config
    output_dir: Path
    admission: Admission
    buffer: GroupBuffer
    scorer: Scorer
    eval_scorer: Scorer
    env: EnvFactory | None
    # ---- set by setup()
    parts: Components
    accounting: Accounting
    supervisor: Supervisor
    weights: WeightPublisher
    producer: Producer
    checkpointer: Checkpointer
    training: TrainingLoop
    # ---- set by run() before setup()
    began: float
    outputs: Outputs
    trace: Trace

    def __init__(
        self,
        config: Config,
        output_dir: str | Path,
        *,
        on_step: Callable[[dict], None] | None = None,
        engine: ManagedEngine | None = None,
        trainer: TrainerBackend | None = None,
        transport: WeightTransport | None = None,
        tokenizer: Any = None,
        clock: Callable[[], float] = time.monotonic,
        resume: bool = False,
        engine_factory: Callable[[], ManagedEngine] | None = None,
        reward_funcs: dict[str, RewardFunc] | None = None,
        env: EnvFactory | None = None,
        runner: TrainerRunner | None = None,
        agent: Agent | None = None,
    ):
        """`engine`, `trainer`, `transport` and `tokenizer` default to the real ones built from the
        config; tests pass fakes that honour the same interfaces (`rollflow.testing`). `runner`
        runs the trainer's calls (default: one dedicated thread); the simulator passes a timed
        one with its virtual `clock` (the event loop's time). `resume`: continue the run in
        `output_dir` from its latest checkpoint. `engine_factory` builds a replacement engine
        when the one in use dies (default: a new vLLM engine like the first; none for a given
        engine). `reward_funcs`: reward functions by name (TRL signature), added to those
        configured in `[[scoring.rewards]]` (an entry with the same name sets its weight and
        timeout). `env`: makes the `Environment` of each multi-turn episode (default: the one
        `env.name` names; none: single-turn samples). `agent`: runs each episode against the
        run's OpenAI-compatible endpoint (default: the function `env.agent` names)."""
        check_training(config)
        check_engines(config)
        self.task = check_task(config)
        """`data.task`, parsed and checked (a verifiers environment brings its own prompts)."""
        self.config = config
        self.output_dir = Path(output_dir)
        self.on_step = on_step
        self.clock = clock
        self.resume = resume
        self._given = Given(engine, engine_factory, trainer, runner, transport, tokenizer)
        self.admission = Admission(config.run.groups_per_step * config.rollout.group_size, config.run.max_lag)
        self.buffer = GroupBuffer()
        self.env = env if env is not None else environment_source(config.env)
        """Makes each episode's environment; None: single-turn samples."""
        self.agent = agent if agent is not None else agent_source(config.env)
        """Runs each episode against the run's OpenAI-compatible endpoint (`rollflow.agent`)."""
        episodes = self.env is not None or self.agent is not None
        rewards = make_rewards(config.scoring, config.run.reward, reward_funcs, env=episodes, task=self.task)
        self.scorer = Scorer(rewards, max_concurrency=config.scoring.max_concurrency)
        """Every training reward, run on whole groups beside generation."""
        self.eval_scorer = eval_scorer(config)
        """Scores held-out evaluations with `run.reward`."""
        self._stop = asyncio.Event()
        self.stall = StallWatch(
            config.run.max_dropped_in_a_row or 4 * config.run.groups_per_step,
            config.run.stall_timeout_s,
            clock=clock,
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
        return self.supervisor.engine

    @property
    def engine_restarts(self) -> int:
        return self.supervisor.restarts

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
                result = await self._run(resumed)
            except BaseException as err:
                steps = self.training.steps_done if hasattr(self, "training") else 0
                owned.record("failed", steps, f"{type(err).__name__}: {err}")
                raise
            owned.record("stopped" if result.stopped else "finished", result.first_step + result.steps)
            return result
        finally:
            owned.release()

    async def _run(self, resumed: tuple[Path, RunState] | None) -> RunResult:
        cfg = self.config
        (self.output_dir / "config.toml").write_text(dump_config(cfg))
        began = self.began = self.clock()
        self.outputs = out = Outputs(self.output_dir, cfg, began)
        self.trace = out.trace
        try:
            await self._start_sources()
            out.waiting(f"loading {cfg.model.path} for the trainer")
            await self.setup()
        except BaseException:
            await self._close_sources()
            out.close()
            raise
        before = after = final = None
        frozen = False
        try:
            if resumed is not None:
                await self._restore(*resumed)
            out.waiting("starting the vLLM engine")
            await self.engine.start()
            await self.weights.strategy.prepare(self.engine)
            await self.producer.start()
            if cfg.run.eval_prompts and resumed is None:
                before = await self._evaluate(cfg.run.eval_pass_k)
            if cfg.run.gc_freeze:
                # No gc.collect() first: a full collection of the startup heap costs a fixed
                # 0.1-0.3 s; garbage frozen with the rest is collected after the run unfreezes.
                gc.freeze()
                frozen = True
            try:
                await self._drive()
            except Exception:  # between steps, the steps trained since the last checkpoint are kept
                training = self.training
                await self.checkpointer.after_error(training.steps_done, training.in_step, self._final_checkpoint)
                raise
            if not self._stop.is_set() and self.checkpointer.enabled:
                await self._final_checkpoint(cfg.run.max_steps)
            if not self._stop.is_set() and cfg.checkpoint.final_model and self.parts.policy_base:
                out.waiting("writing the trained model to final/")
                final = await self.checkpointer.export_final(self.parts.policy_base, lora=cfg.trainer.lora.enabled)
            if cfg.run.eval_prompts and not self._stop.is_set():
                after = await self._evaluate(cfg.run.eval_pass_k)
        finally:
            if frozen:
                gc.unfreeze()
            await self._teardown()
        self.stall.raise_if_fired(self.checkpointer.last)
        training = self.training
        return RunResult(
            steps=len(training.metrics),
            wall_s=self.clock() - began,
            metrics=training.metrics,
            trained_prompts=self.accounting.trained,
            dropped=dict(self.accounting.dropped),
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
        self.stall.stepped()  # the stall clock starts with the run
        try:
            async with asyncio.TaskGroup() as tg:
                producer = tg.create_task(self.producer.run(tg), name="producer")
                probe = tg.create_task(self.outputs.loop_lag.run(), name="loop-lag")
                health = tg.create_task(self.supervisor.watch(), name="engine-health")
                try:
                    await self.training.run(tg)
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

    def _sources(self) -> list[Served]:
        sources: list[object] = [self.env, self.agent]
        return [source for source in sources if isinstance(source, Served)]

    async def _start_sources(self) -> None:
        """Start what the episodes need for the whole run (an OpenEnv server, or check that one
        answers) before anything heavy loads, so a bad address fails in seconds."""
        for source in self._sources():
            self.outputs.waiting(f"starting {type(source).__name__}")
            await source.start()

    async def _close_sources(self) -> None:
        for source in self._sources():
            await source.aclose()

    async def setup(self) -> None:
        """Build every component and wire them; nothing starts running here."""
        rows = self.agent.rows() if isinstance(self.agent, PromptSource) else None
        parts = await build(
            self.config,
            self._given,
            task=self.task,
            multi_turn=self.env is not None or self.agent is not None,
            rows=rows,
        )
        cfg = self.config = parts.config
        self.parts = parts
        self.accounting = Accounting(self.outputs.ledger)
        strategy: WeightStrategy = (
            AdapterWeights(parts.runner, cfg.rollout.partial)
            if cfg.trainer.lora.enabled
            else FullWeights(parts.runner, parts.transport, cfg.rollout.partial)
        )
        self.supervisor = Supervisor(
            parts.engine,
            parts.engine_factory,
            prepare=strategy.prepare,
            max_restarts=cfg.engine.max_restarts,
            health_check_s=cfg.engine.health_check_s,
            trace=self.trace,
            clock=self.clock,
        )
        self.weights = WeightPublisher(strategy, self.supervisor, self.admission, trace=self.trace, clock=self.clock)
        self.producer = Producer(
            cfg,
            sampler=parts.sampler,
            admission=self.admission,
            buffer=self.buffer,
            supervisor=self.supervisor,
            scorer=self.scorer,
            accounting=self.accounting,
            tokenizer=parts.tokenizer,
            trace=self.trace,
            clock=self.clock,
            spec=sampling_spec(cfg),
            env=self.env,
            agent=self.agent,
            chat=parts.chat,
            teacher=parts.teacher,
            stall=self.stall,
        )
        self.checkpointer = Checkpointer(
            self.output_dir,
            cfg,
            parts.runner,
            logs=[self.outputs.ledger, self.outputs.metrics],
            trace=self.trace,
            clock=self.clock,
        )
        self.training = TrainingLoop(
            cfg,
            buffer=self.buffer,
            runner=parts.runner,
            publisher=self.weights,
            producer=self.producer,
            supervisor=self.supervisor,
            accounting=self.accounting,
            checkpointer=self.checkpointer,
            checkpoint=lambda steps, stopping: self._checkpoint(steps, keep_pending=stopping),
            sinks=self.outputs.sinks,
            trace=self.trace,
            loop_lag=self.outputs.loop_lag,
            clock=self.clock,
            stop=self._stop,
            stall=self.stall,
            on_step=self.on_step,
            evaluate=lambda: self._evaluate(cfg.run.eval_pass_k),
        )
        self.training.began = self.began

    async def _teardown(self) -> None:
        """Account for every prompt, then release ranks, threads, scorers, transport and engine."""
        self._settle()
        await self.producer.aclose()
        await self._close_sources()
        await self.parts.runner.aclose()
        await self.scorer.aclose()
        await self.eval_scorer.aclose()
        await self.parts.transport.aclose()
        await self.supervisor.aclose()
        self.outputs.close()

    def _settle(self) -> None:
        """Drop what the run leaves unfinished (unless a checkpoint holds it) and give its
        admission room back: the final checkpoint then counts only samples that were trained."""
        self.accounting.settle(self.buffer, self.producer.take_in_flight(), self.config.rollout.group_size)
        abandoned = self.accounting.take_abandoned()
        if abandoned:
            self.admission.forget(abandoned)

    async def _evaluate(self, pass_k: int = 0) -> HeldOut:
        self.outputs.waiting(f"scoring {self.config.run.eval_prompts} held-out prompts")
        return await evaluate_held_out(self.engine, self.config, self.parts.tokenizer, self.eval_scorer, pass_k=pass_k)


async def train(
    config: Config,
    output_dir: str | Path,
    *,
    on_step: Callable[[dict], None] | None = None,
    resume: bool = False,
    reward_funcs: dict[str, RewardFunc] | None = None,
    env: EnvFactory | None = None,
    agent: Agent | None = None,
) -> RunResult:
    """Run training in the current event loop; writes config.toml, metrics.jsonl, ledger.jsonl
    and checkpoints. `resume`: continue the run in `output_dir` from its latest checkpoint.
    `reward_funcs`: reward functions by name (TRL signature), besides the configured ones.
    `env`: makes each episode's `Environment` (multi-turn), instead of the one `env.name` names.
    `agent`: an OpenAI-API agent runs each episode (`rollflow.agent`), instead of the one
    `env.agent` names."""
    controller = Controller(
        config, output_dir, on_step=on_step, resume=resume, reward_funcs=reward_funcs, env=env, agent=agent
    )
    return await controller.run()
