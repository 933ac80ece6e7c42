"""Building a run from its config: first what is checked and light (`prepare`, when the
controller is made), then the heavy components (`build`, when it runs), unless the caller
passed its own.

`prepare` refuses settings a run cannot use (`rollflow.checks`), parses the task, makes the
source of episodes (`rollflow.episodes`) and the scorers, and returns them as one `Plan`.
`build` returns one `Components` record: tokenizer, sampler, the trainer and the runner its
calls go through, the distillation teacher, the engine and how to build a replacement, and the
weight transport. `Flow` is what the producer and the training loop share. Tests pass fakes
(`rollflow.testing`) and the simulator passes timed ones (`Given`); whatever is not given is
built here. Nothing is started here: the controller starts the engine and the episode source.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from rollflow.buffer import Admission, GroupBuffer
from rollflow.checks import check_task, check_training, context_problem
from rollflow.config import Config
from rollflow.controller.accounting import Accounting
from rollflow.controller.stall import StallWatch
from rollflow.controller.supervisor import Supervisor
from rollflow.controller.trainer_thread import TrainerRunner, TrainerThread
from rollflow.data_files import Row
from rollflow.engine import ManagedEngine
from rollflow.engine.environment import model_context, resolve_context
from rollflow.engine.factory import check_engines, make_engine
from rollflow.envs import ChatFormat
from rollflow.episodes import EpisodeSource
from rollflow.errors import ConfigError
from rollflow.evaluate import split_held_out
from rollflow.models import check_chat_template, load_tokenizer, prompt_encoder, resolve_model
from rollflow.sampler import Sampler
from rollflow.scoring import RewardFunc, Scorer, eval_scorer, make_rewards
from rollflow.sources import episode_source
from rollflow.tasks import Task
from rollflow.trace import Trace
from rollflow.trainer import TrainerBackend
from rollflow.weight_sync import WeightTransport, make_transport


@dataclass
class Given:
    """What the caller passed instead of building from the config (None: build it), and the
    run's clock (the simulator's is virtual)."""

    engine: ManagedEngine | None = None
    engine_factory: Callable[[], ManagedEngine] | None = None
    """Builds a replacement when the engine in use dies (default: a new one like the first;
    none for a given engine)."""
    trainer: TrainerBackend | None = None
    runner: TrainerRunner | None = None
    """Runs the trainer's calls (default: one dedicated thread)."""
    transport: WeightTransport | None = None
    tokenizer: Any = None
    clock: Callable[[], float] = time.monotonic


@dataclass
class Plan:
    """What `prepare` checked and made: everything a run needs before its heavy parts load."""

    config: Config
    task: Task
    """`data.task`, parsed and checked (a verifiers environment brings its own prompts)."""
    episodes: EpisodeSource | None
    """Plays each sample's episode; None: single-turn samples."""
    scorer: Scorer
    """Every training reward, run on whole groups beside generation."""
    eval_scorer: Scorer
    """Scores held-out evaluations with `run.reward`."""


def prepare(
    config: Config,
    *,
    reward_funcs: dict[str, RewardFunc] | None = None,
    env: Any = None,
    agent: Any = None,
) -> Plan:
    """Refuse what the run cannot use (each error names its keys; nothing is written), then make
    the task, the episode source (`env` / `agent`: passed in Python) and the scorers."""
    check_training(config)
    check_engines(config)
    task = check_task(config)
    episodes = episode_source(config, env=env, agent=agent)
    if episodes is not None and episodes.rows() is not None and config.data.paths:  # what it declares
        kind = episodes.settings.__struct_config__.tag
        raise ConfigError(f"data.paths: [env] kind = {kind!r} brings its own prompts; remove data.paths")
    if episodes is not None and config.env is None:  # its defaults are the run's settings
        config = msgspec.structs.replace(config, env=episodes.settings)  # type: ignore[arg-type]
    rewards = make_rewards(config.scoring, config.run.reward, reward_funcs, env=episodes is not None, task=task)
    scorer = Scorer(rewards, max_concurrency=config.scoring.max_concurrency)
    return Plan(config=config, task=task, episodes=episodes, scorer=scorer, eval_scorer=eval_scorer(config, task))


@dataclass
class Flow:
    """What the producer and the training loop share: the capacity rule, the buffer between
    them, the ledger's accounting, the stop rule, the engine's supervisor, the trace, the
    clock and the run's stop request."""

    admission: Admission
    buffer: GroupBuffer
    accounting: Accounting
    stall: StallWatch
    supervisor: Supervisor
    trace: Trace
    clock: Callable[[], float]
    stop: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class Components:
    """A run's built components (none of them started)."""

    tokenizer: Any
    sampler: Sampler
    chat: ChatFormat | None
    """Renders multi-turn conversations (only with an environment)."""
    runner: TrainerRunner
    teacher: Any
    engine: ManagedEngine
    engine_factory: Callable[[], ManagedEngine] | None
    transport: WeightTransport
    config: Config
    """The run's config with what depends on the model made concrete (`engine.max_model_len`)."""
    policy_base: Path | None = None
    """The model folder the trainer was built from (None when a trainer was given)."""
    held_out_rows: list[Row] | None = None
    """The episode source's rows held out for evaluation (its last `run.eval_prompts`), never trained."""


def with_context(config: Config, model_path: Path) -> Config:
    """`engine.max_model_len` made concrete for this model (`0`: its own limit, capped), and the
    completion budget checked against it."""
    engine = resolve_context(config.engine, model_path)
    note = "" if config.engine.max_model_len else f"; {config.model.path} allows {model_context(model_path)}"
    problem = context_problem(config.sampling.max_tokens, engine.max_model_len, f"{engine.max_model_len}", note)
    if problem:
        raise ConfigError(problem)
    return msgspec.structs.replace(config, engine=engine)


async def build(plan: Plan, given: Given) -> Components:
    """The tokenizer, sampler, trainer, teacher, engine and transport: given ones or built
    from the config (the trainer and teacher load in a thread; the loop keeps running). The
    prompts are the episode source's when it brings its own (a verifiers environment's dataset)."""
    config, task = plan.config, plan.task
    multi_turn = plan.episodes is not None
    rows: list[Row] | None = plan.episodes.rows() if plan.episodes is not None else None
    held_out_rows = None
    if rows is not None and config.run.eval_prompts:
        assert config.env is not None
        rows, held_out_rows = split_held_out(
            rows, config.run.eval_prompts, f"[env] kind = {config.env.__struct_config__.tag!r}"
        )
    needs_model = given.tokenizer is None or given.engine is None or (given.trainer is None and given.runner is None)
    model_path = resolve_model(config.model.path) if needs_model else Path(config.model.path)
    config = with_context(config, model_path)
    tokenizer = given.tokenizer or load_tokenizer(model_path)
    if (
        plan.episodes is not None and plan.episodes.renders_chat
    ):  # before the trainer loads: a missing template fails at once
        check_chat_template(tokenizer, config.model.path, "environments render conversations with it")
    elif config.data.template == "chat":
        check_chat_template(tokenizer, config.model.path)
    runner = given.runner or TrainerThread(
        given.trainer or await _load_trainer(config, model_path), config.run.trainer_cpus or None
    )
    teacher = None
    if config.scoring.teacher:
        from rollflow.scoring.distill import Teacher

        teacher = await asyncio.to_thread(Teacher, resolve_model(config.scoring.teacher), config.trainer)
    factory = given.engine_factory
    if given.engine is not None:
        engine = given.engine
    else:
        engine_config = config.engine
        if config.trainer.lora.enabled and not engine_config.max_loras:
            # Every adapter still used by an in-flight request stays loaded: max_lag + 2 of them.
            engine_config = msgspec.structs.replace(engine_config, max_loras=config.run.max_lag + 2)
        if factory is None:

            def factory() -> ManagedEngine:
                return make_engine(model_path, engine_config, config)

        engine = factory()
    return Components(
        tokenizer=tokenizer,
        sampler=Sampler(
            config.data,
            prompt_encoder(tokenizer, config.data),
            task=task,
            rows=rows,
            held_out_seed=config.run.eval_seed,
        ),
        chat=ChatFormat(tokenizer) if multi_turn else None,
        runner=runner,
        teacher=teacher,
        engine=engine,
        engine_factory=factory,
        transport=given.transport
        or make_transport(config.run.weight_transport, host=config.run.weight_sync_host, delta=config.run.weight_delta),
        config=config,
        policy_base=model_path if given.trainer is None and given.runner is None else None,
        held_out_rows=held_out_rows,
    )


async def _load_trainer(config: Config, model_path: Path) -> TrainerBackend:
    import torch

    from rollflow.trainer import Trainer

    torch.set_num_threads(config.run.trainer_threads)
    return await asyncio.to_thread(Trainer, model_path, config.trainer, config.loss)
