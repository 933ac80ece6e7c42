"""The single asyncio controller: it owns every task and keeps the tokens flowing.

Two loops run at once under one TaskGroup:

- the producer: admission (the capacity rule in `buffer.Admission`) -> next prompt -> G rollouts
  streamed concurrently from the engine -> scoring -> group advantages -> the group buffer;
- the training loop: group buffer -> batch (tokens too stale for `max_lag` withheld) -> trainer
  step in a worker thread (the loop keeps streaming meanwhile) -> weight sync into the engine
  -> admission advances -> metrics and ledger lines.

Every prompt ends in `ledger.jsonl` exactly once: trained (at step s) or dropped (with a reason).
Checkpoints (`rollflow.checkpoint`) are taken between steps, at the end and on `request_stop`
(SIGINT / SIGTERM in the CLI); they hold the buffer and every in-flight sample's progress, and a
run built with `resume=True` continues from the latest one without repeating or skipping a
prompt. Shutdown, on completion, error or Ctrl-C, cancels in-flight rollouts (their engine
requests are aborted) and closes the engine. With several trainer ranks, rank 0 runs this controller and the
others run `follow`. This module does not compute losses or move weights itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgspec

from rollflow import faults
from rollflow.advantage import group_advantages, process_advantages
from rollflow.buffer import Admission, GroupBuffer
from rollflow.checkpoint import (
    CHECKPOINTS,
    RESUME_FIXED,
    PendingGroup,
    RunState,
    clean_temporary,
    latest_checkpoint,
    read_state,
    resume_changes,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from rollflow.config import Config, dump_config, load_config
from rollflow.engine.factory import check_engines, make_engine
from rollflow.envs import ChatFormat, EnvFactory, EpisodeLimits, episode_score, load_environment, run_episode
from rollflow.errors import ConfigError, EngineDeadError, EngineError, TrainingError, UserInputError
from rollflow.evaluate import EvalReport, evaluate, sampling_spec
from rollflow.handoff import Load, Save, Step, Stop, Sync, broadcast, build_batch
from rollflow.ledger import LEDGER, LedgerEntry, truncate
from rollflow.metrics import JsonlSink, LoopLag, make_sinks
from rollflow.models import chat_encoder, load_tokenizer, resolve_model
from rollflow.records import Group, Prompt, Sample, SamplingSpec, TrainBatch
from rollflow.rollout import PartialSample, Progress, rollout
from rollflow.sampler import Sampler
from rollflow.scoring import RewardFunc, Scored, Scorer, make_rewards, make_scorer
from rollflow.trace import Trace
from rollflow.trainer import Trainer
from rollflow.weight_sync import make_transport, plan_for, publish

log = logging.getLogger(__name__)


class RunResult(msgspec.Struct):
    """What `train` returns: per-step metrics, prompt accounting and held-out evaluation."""

    steps: int
    wall_s: float
    metrics: list[dict[str, Any]]
    trained_prompts: int
    dropped: dict[str, int]
    eval_before: EvalReport | None = None
    eval_after: EvalReport | None = None
    engine_busy_s: float = 0.0
    """Wall time with at least one group generating."""
    first_step: int = 0
    """The step this run started at (> 0 when resumed from a checkpoint)."""
    stopped: bool = False
    """Stopped early by `request_stop`; the checkpoint holds the work in progress."""
    checkpoint: str | None = None
    """The last checkpoint written."""


class Controller:
    """One training run: engine, trainer, transport, sampler, buffer, and the two loops."""

    def __init__(
        self,
        config: Config,
        output_dir: str | Path,
        *,
        on_step: Callable[[dict], None] | None = None,
        engine: Any = None,
        trainer: Any = None,
        transport: Any = None,
        tokenizer: Any = None,
        clock: Callable[[], float] = time.monotonic,
        resume: bool = False,
        engine_factory: Callable[[], Any] | None = None,
        reward_funcs: dict[str, RewardFunc] | None = None,
        env: EnvFactory | None = None,
    ):
        """`engine`, `trainer`, `transport` and `tokenizer` default to the real ones built from the
        config; tests pass fakes that honour the same interfaces, and the simulator passes simulated
        ones with its virtual `clock` (the event loop's time). `resume`: continue the run in
        `output_dir` from its latest checkpoint. `engine_factory` builds a replacement engine when
        the one in use dies (default: a new vLLM engine like the first; none for a given engine).
        `reward_funcs`: reward functions by name (TRL signature), added to those configured in
        `[[scoring.rewards]]` (an entry with the same name sets its weight and timeout). `env`:
        makes the `Environment` of each multi-turn episode (default: the one `env.name` names;
        none: single-turn samples)."""
        self.clock = clock
        self.resume = resume
        self._engine_factory = engine_factory
        self.config = config
        self._given = {"engine": engine, "trainer": trainer, "transport": transport, "tokenizer": tokenizer}
        self.output_dir = Path(output_dir)
        self.on_step = on_step
        run = config.run
        check_engines(config)
        self.samples_per_step = run.groups_per_step * config.rollout.group_size
        self.admission = Admission(self.samples_per_step, run.max_lag)
        self.buffer = GroupBuffer()
        self.score = make_scorer(run.reward)
        """The built-in reward, for held-out evaluation."""
        if env is None and config.env.name:
            env = load_environment(config.env.name, tool_timeout_s=config.env.tool_timeout_s)
        self.env = env
        """Makes each episode's environment; None: single-turn samples."""
        self._limits = EpisodeLimits(
            max_turns=config.env.max_turns,
            max_tokens=config.env.max_tokens,
            max_model_len=config.engine.max_model_len,
            step_timeout_s=config.env.step_timeout_s,
        )
        rewards = make_rewards(config.scoring, run.reward, reward_funcs, env=env is not None)
        self.scorer = Scorer(rewards, max_concurrency=config.scoring.max_concurrency)
        """Every training reward, run on whole groups beside generation."""
        self.spec = sampling_spec(config)
        self._inflight: dict[str, asyncio.Task[None]] = {}
        """Groups generating, by prompt id."""
        self._tasks: dict[str, asyncio.Task[None]] = {}
        """Every group's task until it is in the buffer or dropped (generating or being scored)."""
        self._dropped: dict[str, int] = {}
        self._generated_tokens = 0
        self._group_seq = 0
        self._trained = 0
        self._stepping: list[Group] = []
        self._busy_since: float | None = None
        self._update: asyncio.Task[None] | None = None
        """The engine's load of the latest staged weights (runs while the next step trains)."""
        self._last_update_s = 0.0
        self._trainer_thread = ThreadPoolExecutor(1, "rollflow-trainer", initializer=self._bind_trainer_thread)
        """Every trainer step runs on this one thread, so the event loop keeps streaming."""
        self.engine_busy_s = 0.0
        """Wall time with at least one group generating (the engine's busy time)."""
        self._progress: dict[str, tuple[Prompt, str, list[Progress]]] = {}
        """Groups generating or being scored, with each sample's progress (what a checkpoint saves)."""
        self._consumed: list[str] = []
        self._stop = asyncio.Event()
        self._pending_saved = False
        """The buffer and in-flight groups live on in a checkpoint: they are not dropped at exit."""
        self._restored: RunState | None = None
        self._first_step = 0
        self._wall_offset = 0.0
        self._nonfinite_streak = 0
        self._last_checkpoint: Path | None = None
        self.teacher: Any = None
        """On-policy distillation: scores the student's tokens (`scoring.teacher`)."""
        self._teacher_thread = ThreadPoolExecutor(1, "rollflow-teacher")
        self._steps_run = 0
        """Trainer steps completed (counted on the trainer thread, next to the weights)."""
        self.engine_restarts = 0
        self._recovery_lock = asyncio.Lock()
        self._stage_lock = asyncio.Lock()
        """Held while weights are read out of the trainer (publishing, or loading a new engine)."""

    @property
    def stopping(self) -> bool:
        """A stop was requested."""
        return self._stop.is_set()

    def request_stop(self) -> None:
        """Stop after the current step: checkpoint the run with its work in progress and return
        (the CLI calls this on SIGINT / SIGTERM). Safe to call from a signal handler on the loop."""
        self._stop.set()

    # ---- the run ------------------------------------------------------------------------

    async def run(self) -> RunResult:
        cfg = self.config
        checkpoint = self._prepare_output_dir()
        (self.output_dir / "config.toml").write_text(dump_config(cfg))
        began = self.clock()
        self.trace = Trace(cfg.observe.trace_max_events, began=began)
        self.loop_lag = LoopLag(cfg.observe.loop_probe_s)
        self.sinks = make_sinks(
            cfg.observe.sinks,
            self.output_dir,
            total_steps=cfg.run.max_steps,
            project=cfg.observe.wandb_project,
            mode=cfg.observe.wandb_mode,
            config=msgspec.to_builtins(cfg),
        )
        self.metrics_file = JsonlSink(self.output_dir / "metrics.jsonl")
        self.sinks.insert(0, self.metrics_file)
        self.ledger = JsonlSink(self.output_dir / LEDGER)
        try:
            await self._build()
        except BaseException:
            self._close_sinks()
            raise
        metrics: list[dict[str, Any]] = []
        eval_before = eval_after = None
        frozen = False
        try:
            if checkpoint is not None:
                await self._restore(checkpoint)
            await self.engine.start()
            if not cfg.trainer.lora.enabled:
                await self.transport.connect(self.engine)
                specs = [(n, t.dtype, tuple(t.shape)) for n, t in self._weight_specs()]
                self.plan = plan_for(specs)
            if self._first_step > 0:
                await self._load_trainer_weights(self.engine)
            if cfg.run.eval_prompts and checkpoint is None:
                eval_before = await self._evaluate()
            if cfg.run.gc_freeze:
                # No gc.collect() first: a full collection of the startup heap costs a fixed
                # 0.1-0.3 s; garbage frozen with the rest is collected after the run unfreezes.
                gc.freeze()
                frozen = True
            try:
                async with asyncio.TaskGroup() as tg:
                    producer = tg.create_task(self._produce(tg), name="producer")
                    probe = tg.create_task(self.loop_lag.run(), name="loop-lag")
                    health = tg.create_task(self._watch_engine(), name="engine-health")
                    try:
                        await self._train(tg, metrics, began)
                    finally:
                        await self.admission.close()
                        producer.cancel()
                        probe.cancel()
                        health.cancel()
                        for task in self._tasks.values():
                            task.cancel()
            except ExceptionGroup as group:
                first = group.exceptions[0]
                if all(type(e) is type(first) and str(e) == str(first) for e in group.exceptions):
                    raise first from None  # one failure, seen by one or more tasks: raise it plainly
                raise
            if not self._stop.is_set() and cfg.checkpoint.enabled:
                self._account_leftovers()  # the final checkpoint holds no work in progress
                await self._checkpoint(cfg.run.max_steps, began)
            if cfg.run.eval_prompts and not self._stop.is_set():
                eval_after = await self._evaluate()
        finally:
            if frozen:
                gc.unfreeze()
            self._account_leftovers()
            if self.trainer.world_size > 1:
                await asyncio.to_thread(broadcast, Stop())
            self._trainer_thread.shutdown(wait=False)
            self._teacher_thread.shutdown(wait=False)
            await self.scorer.aclose()
            await self.transport.aclose()
            await self.engine.aclose()
            self._close_sinks()
            if cfg.observe.trace:
                self.trace.write(self.output_dir / "trace.json")
        return RunResult(
            steps=len(metrics),
            wall_s=self.clock() - began,
            metrics=metrics,
            trained_prompts=self._trained,
            dropped=dict(self._dropped),
            eval_before=eval_before,
            eval_after=eval_after,
            engine_busy_s=self.engine_busy_s,
            first_step=self._first_step,
            stopped=self._stop.is_set(),
            checkpoint=str(self._last_checkpoint) if self._last_checkpoint else None,
        )

    async def _build(self) -> None:
        """The tokenizer, sampler, trainer, teacher, engine and transport: given ones or built
        from the config."""
        cfg = self.config
        given = self._given
        needs_model = any(given[k] is None for k in ("tokenizer", "trainer", "engine"))
        model_path = resolve_model(cfg.model.path) if needs_model else Path(cfg.model.path)
        self.tokenizer = given["tokenizer"] or load_tokenizer(model_path)
        encode = chat_encoder(self.tokenizer)
        self.chat = ChatFormat(self.tokenizer) if self.env is not None else None
        self.sampler = Sampler(cfg.data, encode)
        if given["trainer"] is None:
            import torch

            torch.set_num_threads(cfg.run.trainer_threads)
        self.trainer = given["trainer"] or await asyncio.to_thread(Trainer, model_path, cfg.trainer, cfg.loss)
        if cfg.scoring.teacher:
            from rollflow.scoring.distill import Teacher

            teacher_path = resolve_model(cfg.scoring.teacher)
            self.teacher = await asyncio.to_thread(Teacher, teacher_path, cfg.trainer)
        engine_config = cfg.engine
        if cfg.trainer.lora.enabled and not engine_config.max_loras:
            # Every adapter still used by an in-flight request stays loaded: max_lag + 2 of them.
            engine_config = msgspec.structs.replace(engine_config, max_loras=cfg.run.max_lag + 2)
        if given["engine"] is not None:
            self.engine = given["engine"]
        else:
            if self._engine_factory is None:
                self._engine_factory = lambda: make_engine(model_path, engine_config, cfg)
            self.engine = self._engine_factory()
        self.transport = given["transport"] or make_transport(cfg.run.weight_transport, host=cfg.run.weight_sync_host)

    def _close_sinks(self) -> None:
        for sink in self.sinks:
            sink.close()
        self.ledger.close()

    def _prepare_output_dir(self) -> Path | None:
        """Check the output directory for a new or a resumed run; returns the checkpoint to
        resume from. On resume, the ledger and metrics are cut back to the checkpoint."""
        out = self.output_dir
        existing = [n for n in ("metrics.jsonl", LEDGER) if (out / n).exists()]
        if not self.resume:
            if existing:
                raise UserInputError(
                    f"{out}: already holds a run ({', '.join(existing)}); resume it with --resume "
                    "or choose a new output directory"
                )
            out.mkdir(parents=True, exist_ok=True)
            return None
        checkpoint = latest_checkpoint(out)
        if checkpoint is None:
            raise UserInputError(f"{out}: no checkpoint to resume from in {out / CHECKPOINTS}; start without --resume")
        self._check_resumable(out / "config.toml")
        clean_temporary(out)
        state = read_state(checkpoint)
        if state.step >= self.config.run.max_steps:
            raise UserInputError(
                f"{checkpoint}: the run already did {state.step} steps (run.max_steps = {self.config.run.max_steps}); "
                "raise --max-steps to train further"
            )
        truncate(out / LEDGER, state.ledger_bytes)
        truncate(out / "metrics.jsonl", state.metrics_bytes)
        self._restored = state
        log.info("resuming from %s (step %d)", checkpoint, state.step)
        return checkpoint

    def _check_resumable(self, saved: Path) -> None:
        """Refuse to resume with settings the checkpoint depends on changed (`RESUME_FIXED`)."""
        if not saved.exists():
            log.warning("%s is missing: cannot check that the resumed run's settings match", saved)
            return
        try:
            previous = load_config(saved)
        except ConfigError as err:
            log.warning("cannot check the resumed run's settings against %s: %s", saved, err)
            return
        changes = resume_changes(previous, self.config)
        if changes:
            raise UserInputError(
                f"{saved}: cannot resume this run with different {', '.join(RESUME_FIXED)} settings; changed: "
                + "; ".join(changes)
                + ". Put them back, or start a new run in another output directory"
            )

    async def _restore(self, checkpoint: Path) -> None:
        """Put the trainer, sampler, admission, buffer and counters back as the checkpoint has them
        (in-flight groups are relaunched by the producer, engine weights after the engine starts)."""
        state = self._restored
        assert state is not None
        path = checkpoint / "trainer"

        def load() -> None:
            if self.trainer.world_size > 1:
                broadcast(Load(path=str(path), rest=msgspec.msgpack.encode(state.trainer)))
            self.trainer.load(path, state.trainer)

        await asyncio.get_running_loop().run_in_executor(self._trainer_thread, load)
        set_rng_state(state.rng)
        self.sampler.load_state_dict(state.sampler)
        self._consumed = list(state.consumed)
        self._group_seq = state.group_seq
        self._trained = state.trained
        self._dropped = dict(state.dropped)
        self._nonfinite_streak = state.nonfinite_streak
        self._first_step = self._steps_run = state.step
        self._wall_offset = state.wall_s
        self.admission.started = state.started
        await self.admission.advance(state.step)
        for group in state.buffer:
            await self.buffer.put(group)

    # ---- checkpoints --------------------------------------------------------------------

    def _snapshot(self, step: int, began: float) -> RunState:
        """The run's state at this instant (no await inside: nothing changes while it is taken)."""
        return RunState(
            step=step,
            wall_s=self.clock() - began + self._wall_offset,
            trainer={},
            rng=rng_state(),
            sampler=self.sampler.state_dict(),
            consumed=list(self._consumed),
            group_seq=self._group_seq,
            started=self.admission.started,
            trained=self._trained,
            dropped=dict(self._dropped),
            nonfinite_streak=self._nonfinite_streak,
            buffer=self.buffer.snapshot(),
            in_flight=[
                PendingGroup(prompt=prompt, group_id=group_id, samples=[p.snapshot(self.engine) for p in progress])
                for prompt, group_id, progress in self._progress.values()
            ],
            ledger_bytes=self.ledger.sync(),
            metrics_bytes=self.metrics_file.sync(),
        )

    async def _checkpoint(self, step: int, began: float, *, keep_pending: bool = False) -> Path:
        """Write a checkpoint after `step` steps. `keep_pending`: the run is stopping; its
        buffered and in-flight work is saved and then cancelled without being dropped."""
        state = self._snapshot(step, began)
        if keep_pending:
            self._pending_saved = True
            await self.admission.close()
            for task in self._tasks.values():
                task.cancel()
        began_write = self.clock()

        def save_tensors(path: Path) -> dict[str, Any]:
            if self.trainer.world_size > 1:
                broadcast(Save(path=str(path)))
            return self.trainer.save(path)

        def write() -> Path:
            return save_checkpoint(
                self.output_dir, state, save_tensors, step=step, keep_last=self.config.checkpoint.keep_last
            )

        path = await asyncio.get_running_loop().run_in_executor(self._trainer_thread, write)
        self.trace.span("checkpoint", "trainer", began_write, self.clock(), step=step, path=path.name)
        self._last_checkpoint = path
        log.info("checkpoint %s written in %.1f s", path, self.clock() - began_write)
        return path

    def _bind_trainer_thread(self) -> None:
        cpus = self.config.run.trainer_cpus
        if cpus and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, cpus)  # 0: the calling thread

    def _weight_specs(self):
        # Names, dtypes and global shapes without gathering (FSDP2 DTensors know their full shape).
        return self.trainer.lm.state_dict().items()

    # ---- producer: prompts -> groups ----------------------------------------------------

    async def _produce(self, tg: asyncio.TaskGroup) -> None:
        group_size = self.config.rollout.group_size
        if self._restored is not None:  # groups in flight at the checkpoint continue first
            for pending in self._restored.in_flight:
                self._launch(tg, pending.prompt, pending.group_id, pending.samples)
            self._restored = None
        while await self.admission.acquire(group_size):
            prompt = self.sampler.next()
            self._consumed.append(prompt.id)
            group_id = f"g{self._group_seq}"
            self._group_seq += 1
            self._launch(tg, prompt, group_id, [PartialSample() for _ in range(group_size)])

    def _launch(self, tg: asyncio.TaskGroup, prompt: Prompt, group_id: str, start: list[PartialSample]) -> None:
        if not self._inflight:
            self._busy_since = self.clock()
        progress = [Progress(s) for s in start]
        self._progress[prompt.id] = (prompt, group_id, progress)
        task = tg.create_task(self._group(prompt, group_id, progress), name=f"group-{prompt.id}")
        self._inflight[prompt.id] = self._tasks[prompt.id] = task

    async def _group(self, prompt: Prompt, group_id: str, progress: list[Progress]) -> None:
        try:
            await self._generate_and_score(prompt, group_id, progress)
        finally:
            self._progress.pop(prompt.id, None)
            self._tasks.pop(prompt.id, None)

    async def _generate_and_score(self, prompt: Prompt, group_id: str, progress: list[Progress]) -> None:
        cfg = self.config
        # Owned here: awaited together below, and cancelled together if any fails.
        tasks = [
            asyncio.create_task(self._rollout(prompt, group_id, i, p), name=f"rollout-{group_id}/{i}")
            for i, p in enumerate(progress)
        ]
        try:
            samples = await asyncio.gather(*tasks)
        except BaseException as err:
            # One sample failed or the run is ending: stop the group's other samples too.
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._finished(prompt.id)
            if isinstance(err, asyncio.CancelledError):
                if not self._pending_saved:
                    self._drop(prompt.id, "run ended: in flight")
                raise
            if isinstance(err, EngineError) and not isinstance(err, EngineDeadError):
                self._drop(prompt.id, f"engine error: {err}")
                await self.admission.release(len(tasks))
                return
            self._drop(prompt.id, f"run failed: {err}")  # the error ends the run; the prompt is still accounted for
            raise
        self._finished(prompt.id)
        began = self.clock()
        self._generated_tokens += sum(sample.num_tokens for sample in samples)
        texts = [self.tokenizer.decode(s.completion_token_ids, skip_special_tokens=True) for s in samples]
        prior = [episode_score(s) for s in samples] if self.env is not None else None
        try:
            results = await self.scorer.score(prompt, texts, [s.completion_token_ids for s in samples], prior)
            if self.teacher is not None:
                samples, results = await self._teacher_logprobs(samples, results)
        except asyncio.CancelledError:
            if not self._pending_saved:
                self._drop(prompt.id, "run ended: being scored")
            raise
        scored = [
            msgspec.structs.replace(
                sample, reward=r.reward, unscorable=r.reason, reward_parts=r.parts, process_rewards=r.steps
            )
            for sample, r in zip(samples, results, strict=True)
        ]
        self.trace.span("reward", "reward", began, self.clock(), prompt=prompt.id, rewards=[s.reward for s in scored])
        if all(s.reward is None for s in scored):
            self._drop(prompt.id, f"unscorable: {scored[0].unscorable}")
            await self.admission.release(len(scored))
            return
        adv = group_advantages([s.reward for s in scored], estimator=cfg.loss.advantage, scale_std=cfg.loss.scale_std)
        credit: list[list[float] | None] = []
        if cfg.scoring.process_coef and any(s.process_rewards for s in scored):
            per_token = process_advantages(
                [s.process_rewards if s.reward is not None else None for s in scored],
                [s.num_tokens for s in scored],
                scale_std=cfg.loss.scale_std,
            )
            credit = [None if t is None else [cfg.scoring.process_coef * a for a in t] for t in per_token]
        await self.buffer.put(Group(prompt=prompt, samples=scored, advantages=adv.advantages, token_advantages=credit))

    async def _teacher_logprobs(
        self, samples: list[Sample], results: list[Scored]
    ) -> tuple[list[Sample], list[Scored]]:
        """Attach the teacher's log-probs of every sampled token; a failure makes the samples
        unscorable with the reason."""
        loop = asyncio.get_running_loop()
        try:
            logprobs = await loop.run_in_executor(self._teacher_thread, self.teacher, samples)
        except Exception as err:  # the teacher is a scoring stage: its failure is a reason, not a crash
            reason = f"teacher: raised {type(err).__name__}: {err}"
            return samples, [Scored(None, r.reason or reason, r.parts) for r in results]
        return [
            msgspec.structs.replace(s, teacher_logprobs=lp) for s, lp in zip(samples, logprobs, strict=True)
        ], results

    async def _rollout(self, prompt: Prompt, group_id: str, index: int, progress: Progress) -> Sample:
        lane = self.trace.lane()
        version, began = self.engine.version, self.clock()
        try:
            if self.env is None:
                sample = await self._stream(prompt, self.spec, group_id, index, progress)
            else:
                sample = await self._episode(prompt, group_id, index, progress)
        except BaseException:
            self.trace.span("generate (ended early)", lane, began, self.clock(), prompt=prompt.id, sample=index)
            raise
        finally:
            self.trace.release(lane)
        self.trace.span(
            "generate",
            lane,
            began,
            self.clock(),
            prompt=prompt.id,
            sample=index,
            tokens=sample.num_tokens,
            version_start=sample.versions[0] if sample.versions else version,
            version_end=sample.versions[-1] if sample.versions else version,
            interruptions=sample.interruptions,
            turns=sample.turns,
        )
        return sample

    async def _stream(
        self, prompt: Prompt, spec: SamplingSpec, group_id: str, index: int, progress: Progress
    ) -> Sample:
        """One generation, carried over to a new engine (from the tokens it had) if the engine dies."""
        while True:
            engine = self.engine
            try:
                return await rollout(
                    engine,
                    prompt,
                    spec,
                    group_id=group_id,
                    index=index,
                    partial=self.config.rollout.partial,
                    progress=progress,
                )
            except EngineDeadError as err:
                await self._recover(engine, err)  # then continue from the progress kept

    async def _episode(self, prompt: Prompt, group_id: str, index: int, progress: Progress) -> Sample:
        """A multi-turn episode. Its progress is saved only once it is done: a checkpoint taken
        mid-episode restarts it from its prompt (an environment's state cannot be saved)."""
        assert self.env is not None and self.chat is not None
        if progress.saved.done is not None:  # finished before the checkpoint this run resumed from
            return progress.saved.done

        async def turn(token_ids: list[int], spec: SamplingSpec, n: int) -> Sample:
            turn_prompt = Prompt(id=prompt.id, token_ids=token_ids)
            return await self._stream(turn_prompt, spec, f"{group_id}/t{n}", index, Progress())

        sample = await run_episode(
            self.env(), prompt, self.spec, turn, self.chat, group_id=group_id, index=index, limits=self._limits
        )
        progress.saved = PartialSample(done=sample)
        return sample

    def _busy_total(self) -> float:
        """Engine busy time so far, counting the current busy stretch."""
        current = self.clock() - self._busy_since if self._busy_since is not None else 0.0
        return self.engine_busy_s + current

    def _finished(self, prompt_id: str) -> None:
        self._inflight.pop(prompt_id, None)
        if not self._inflight and self._busy_since is not None:
            self.engine_busy_s += self.clock() - self._busy_since
            self._busy_since = None

    # ---- training loop: groups -> steps -> weights ----------------------------------------

    async def _train(self, tg: asyncio.TaskGroup, metrics: list[dict[str, Any]], began: float) -> None:
        run = self.config.run
        loop = asyncio.get_running_loop()
        every = self.config.checkpoint.every if self.config.checkpoint.enabled else 0
        for step in range(self._first_step, run.max_steps):
            t0 = self.clock()
            tokens_before, busy_before = self._generated_tokens, self._busy_total()
            groups = await self._take_or_stop(run.groups_per_step)
            if groups is None:
                break
            self._stepping = groups  # out of the buffer, not yet in the ledger
            t_batch = self.clock()
            batch, stats = build_batch(
                step,
                groups,
                max_lag=run.max_lag,
                max_tokens=self.config.env.max_tokens if self.env else self.config.sampling.max_tokens,
                reward_name=run.reward,
                distill_coef=self.config.scoring.distill_coef,
            )
            trained: dict[str, float] = {}
            if batch.samples and hasattr(self.trainer, "step_async"):  # a simulated or remote trainer
                trained = await self.trainer.step_async(batch)
            elif batch.samples:
                trained = await loop.run_in_executor(self._trainer_thread, self._step, batch)
            self._steps_run = step + 1
            t_step = self.clock()
            self.trace.span("train step", "trainer", t_batch, t_step, step=step, samples=stats["samples"])
            for i, (start, end, n_samples, n_tokens) in enumerate(getattr(self.trainer, "micro_batches", [])):
                self.trace.span(
                    "micro-batch", "trainer", start, end, step=step, index=i, samples=n_samples, tokens=n_tokens
                )
            faults.point("step-trained")
            staged_bytes = await self._publish(tg, step + 1)
            t_sync = self.clock()
            self.trace.span("stage weights", "weight sync", t_step, t_sync, step=step, bytes=staged_bytes)
            skipped = bool(trained.get("skipped"))
            for group in groups:
                if skipped:
                    self._drop(group.prompt.id, f"non-finite loss: step {step} was skipped")
                    continue
                lengths = [sample.num_tokens for sample in group.samples]
                self.ledger.write(LedgerEntry(id=group.prompt.id, outcome="trained", step=step, tokens=lengths))
            self._trained += 0 if skipped else len(groups)
            self._stepping = []
            self._nonfinite_streak = self._nonfinite_streak + 1 if skipped else 0
            interval = t_sync - t0

            def per_s(amount: float, interval: float = interval) -> float:
                return amount / interval if interval > 0 else 0.0

            busy = self._busy_total()
            row = {
                "step": step,
                "version": step + 1,
                **stats,
                "ratio_mean": trained.get("ratio_mean", 1.0),
                "trainer_idle_frac": per_s(t_batch - t0),
                "engine_idle_frac": max(0.0, 1.0 - per_s(busy - busy_before)),
                "gen_tokens_per_s": per_s(self._generated_tokens - tokens_before),
                "trained_tokens_per_s": per_s(stats["tokens"]),
                "samples_per_s": per_s(stats["samples"]),
                "weight_sync_s": t_sync - t_step,
                "weight_sync_bytes": staged_bytes,
                "engine_update_s": self._last_update_s,
                "batch_wait_s": t_batch - t0,
                "train_step_s": t_step - t_batch,
                "buffer_groups": len(self.buffer),
                "engine_busy_s": busy,
                **self.loop_lag.take(),
                "wall_s": t_sync - began + self._wall_offset,
                "engine_restarts": self.engine_restarts,
                "loss_tokens": trained.get("tokens", 0.0),
                **{k: v for k, v in trained.items() if k not in ("ratio_mean", "tokens")},
            }
            metrics.append(row)
            for sink in self.sinks:
                sink.write(row)
            if self.on_step is not None:
                self.on_step(row)
            if self._nonfinite_streak >= self.config.checkpoint.max_nonfinite_steps:
                where = "checkpoints are off (checkpoint.enabled = false)"
                if self.config.checkpoint.enabled:
                    saved = await self._checkpoint(step + 1, began, keep_pending=True)
                    where = f"the last good weights and all pending work are in {saved}; resume with --resume"
                raise TrainingError(
                    f"{self._nonfinite_streak} steps in a row had a non-finite loss or gradient (last: step {step}); "
                    f"stopping: {where}. Lower trainer.lr or check the rewards first"
                )
            if self._stop.is_set():
                break
            if every and (step + 1) % every == 0 and step + 1 < run.max_steps:
                await self._checkpoint(step + 1, began)
        if self._stop.is_set():
            if self.config.checkpoint.enabled:
                await self._checkpoint(self._steps_done(metrics), began, keep_pending=True)
            return
        await self.admission.close()  # no step is left to consume new samples
        if self._update is not None:
            await self._update  # the last step's weights are in the engine when the run returns

    def _steps_done(self, metrics: list[dict[str, Any]]) -> int:
        return metrics[-1]["step"] + 1 if metrics else self._first_step

    async def _take_or_stop(self, n: int) -> list[Group] | None:
        """The next `n` groups, or None if a stop is requested first."""
        if self._stop.is_set():
            return None
        take = asyncio.ensure_future(self.buffer.take(n))
        stop = asyncio.ensure_future(self._stop.wait())
        try:
            await asyncio.wait({take, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
            if not take.done():
                take.cancel()
            await asyncio.gather(take, stop, return_exceptions=True)
        return take.result() if not take.cancelled() else None

    def _step(self, batch: TrainBatch) -> dict[str, float]:
        if self.trainer.world_size > 1:
            broadcast(Step(batch=batch))
        out = self.trainer.step(batch)
        self._steps_run = batch.step + 1
        return out

    async def _publish(self, tg: asyncio.TaskGroup, version: int) -> int:
        """Hand the step's weights to the engine; returns the bytes staged.

        The training loop waits for the previous engine update (one at a time: the staging area
        is reused) and for the copy of the new weights out of the trainer; the engine then loads
        them in its critical section while the next step trains, when the transport's copy is a
        snapshot. Admission advances once the engine serves the new version.
        """
        cfg = self.config
        if self._update is not None:
            await self._update
        if cfg.trainer.lora.enabled:
            began = self.clock()
            async with self._stage_lock:
                weights = self.trainer.adapter_weights()
            engine = self.engine
            if engine.version < version:  # else a restarted engine was given these weights already
                try:
                    await engine.update_adapter(
                        weights, self.trainer.adapter_config(), partial=cfg.rollout.partial, version=version
                    )
                except EngineDeadError as err:
                    await self._recover(engine, err)
            self._updated(began)
            await self.admission.advance(self.engine.version)
            return sum(t.numel() * t.element_size() for t in weights.values())
        async with self._stage_lock:
            if self.trainer.world_size > 1:
                await asyncio.to_thread(broadcast, Sync())
            staged = await self.transport.stage(self.plan, self.trainer.full_weights())
        self._update = tg.create_task(self._load_into_engine(version), name="engine-update")
        if not self.transport.snapshots:
            await self._update
        return staged

    async def _load_into_engine(self, version: int) -> None:
        began = self.clock()
        faults.point("weight-sync")
        engine = self.engine
        if engine.version < version:  # else a restarted engine was given these weights already
            try:
                await publish(engine, self.transport, self.plan, partial=self.config.rollout.partial, version=version)
            except EngineDeadError as err:
                await self._recover(engine, err)
        self._updated(began)
        await self.admission.advance(self.engine.version)

    # ---- engine failure -------------------------------------------------------------------

    async def _watch_engine(self) -> None:
        """Ask the engine now and then whether it lives (requests notice a death at once; this
        covers the moments when none is streaming)."""
        interval = self.config.engine.health_check_s
        while True:
            await asyncio.sleep(interval)
            engine = self.engine
            check = getattr(engine, "check_health", None)
            if check is None:
                return
            try:
                await check()
            except EngineDeadError as err:
                await self._recover(engine, err)

    async def _recover(self, dead: Any, err: EngineDeadError) -> None:
        """Replace a dead engine; returns once a new one serves the trainer's current weights.

        Whoever notices the death first (a request, a weight load, the health check) restarts the
        engine; the others wait on the lock and find it replaced. The new engine gets the weights
        the trainer holds now, read on the trainer thread between steps and labelled with the
        number of steps they carry, so every token keeps an exact version. In-flight samples then
        continue from the tokens they had (rollout keeps them), like a `resume` after an update.
        """
        async with self._recovery_lock:
            if self.engine is not dead:
                return
            limit = self.config.engine.max_restarts
            if self._engine_factory is None or self.engine_restarts >= limit:
                raise EngineDeadError(f"{err}; not restarted ({self.engine_restarts} of engine.max_restarts = {limit})")
            self.engine_restarts += 1
            log.error("%s; restarting the engine (%d of %d)", err, self.engine_restarts, limit)
            began = self.clock()
            with contextlib.suppress(Exception):
                await dead.aclose()
            engine = self._engine_factory()
            await engine.start()
            if not self.config.trainer.lora.enabled:
                await self.transport.connect(engine)
            version = await self._load_trainer_weights(engine)
            self.engine = engine
            self.trace.span("engine restart", "engine update", began, self.clock(), version=version)
            log.error("engine restarted in %.1f s, serving version %d", self.clock() - began, version)

    async def _load_trainer_weights(self, engine: Any) -> int:
        """Give a freshly started engine (a resumed run's, or a dead one's replacement) the
        trainer's current weights, labelled with the number of steps they carry; returns that
        version. They are read on the trainer thread, so never halfway through a step."""
        loop = asyncio.get_running_loop()
        async with self._stage_lock:
            version, weights = await loop.run_in_executor(self._trainer_thread, self._current_weights)
        if version > 0 and self.config.trainer.lora.enabled:
            await engine.update_adapter(weights, self.trainer.adapter_config(), version=version)
        elif version > 0:
            await engine.update_weights(weights, version=version)
        return version

    def _current_weights(self) -> tuple[int, dict[str, Any]]:
        """(steps the trainer has run, its weights), read on the trainer thread."""
        if self._steps_run == 0:
            return 0, {}  # the engine starts with these weights
        if self.config.trainer.lora.enabled:
            return self._steps_run, self.trainer.adapter_weights()
        if self.trainer.world_size > 1:
            broadcast(Sync())
        return self._steps_run, {name: tensor.clone() for name, tensor in self.trainer.full_weights()}

    def _updated(self, began: float) -> None:
        now = self.clock()
        self._last_update_s = now - began
        self.trace.span("engine update", "engine update", began, now, version=self.engine.version)

    async def _evaluate(self) -> EvalReport:
        cfg = self.config
        held_out = Sampler(msgspec.structs.replace(cfg.data, seed=cfg.run.eval_seed), chat_encoder(self.tokenizer))
        prompts = [held_out.next() for _ in range(cfg.run.eval_prompts)]
        return await evaluate(
            self.engine,
            prompts,
            sampling_spec(cfg, greedy=True),
            samples_per_prompt=1,
            decode=lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True),
            score=lambda p, text: self.score(p, text)[0],
        )

    # ---- accounting ---------------------------------------------------------------------

    def _drop(self, prompt_id: str, reason: str) -> None:
        self.ledger.write(LedgerEntry(id=prompt_id, outcome="dropped", reason=reason))
        key = reason.split(":")[0]
        self._dropped[key] = self._dropped.get(key, 0) + 1

    def _account_leftovers(self) -> None:
        """Prompts started but not trained when the run ends are dropped with a reason (unless a
        checkpoint of a stopped run holds them)."""
        if self._pending_saved:
            self._inflight.clear()
            return
        for group in self._stepping:
            self._drop(group.prompt.id, "run ended: its step was interrupted")
        self._stepping = []
        for group in self.buffer.drain():
            self._drop(group.prompt.id, "run ended: generated, not trained")
        for prompt_id in list(self._inflight):
            self._drop(prompt_id, "run ended: in flight")
        self._inflight.clear()


def follow(trainer: Trainer) -> None:
    """The loop of trainer ranks other than 0: step and gather weights as rank 0 says."""
    while True:
        message = broadcast(None)
        match message:
            case Step(batch=batch):
                trainer.step(batch)
            case Sync():
                for _ in trainer.full_weights():
                    pass
            case Save(path=path):
                trainer.save(Path(path))
            case Load(path=path, rest=rest):
                trainer.load(Path(path), msgspec.msgpack.decode(rest))
            case Stop():
                return


async def train(
    config: Config,
    output_dir: str | Path,
    *,
    on_step: Callable[[dict], None] | None = None,
    resume: bool = False,
    reward_funcs: dict[str, RewardFunc] | None = None,
    env: EnvFactory | None = None,
) -> RunResult:
    """Run training in the current event loop; writes config.toml, metrics.jsonl, ledger.jsonl
    and checkpoints. `resume`: continue the run in `output_dir` from its latest checkpoint.
    `reward_funcs`: reward functions by name (TRL signature), besides the configured ones.
    `env`: makes each episode's `Environment` (multi-turn), instead of the one `env.name` names."""
    controller = Controller(config, output_dir, on_step=on_step, resume=resume, reward_funcs=reward_funcs, env=env)
    return await controller.run()
