"""Settings a training run cannot use, refused before anything loads, each naming its keys.

`check_training` raises `ConfigError` on the first of `training_problems`: combinations that would
fail later or silently do something else (greedy sampling for training, a completion budget that
cannot fit the context, `data.paths` with a task that does not read them, ...), and group sizes
whose samples in flight cannot fit in memory (`memory_problem`). Other commands (`generate`,
`eval`) load the same config without these checks. This module does not load or resolve configs
(`rollflow.config`) or look at the model (the context check against the model's own limit is in
`rollflow.controller.setup`).
"""

from __future__ import annotations

import os
from pathlib import Path

from rollflow.config import CONTEXT_CAP, Config, EndpointConfig, OpenEnvConfig
from rollflow.errors import ConfigError
from rollflow.tasks import Task, parse_task


def check_training(config: Config) -> None:
    """Refuse settings a training run cannot use, though other commands can (e.g. `generate`),
    and combinations that would fail later or silently do something else; each names its keys."""
    for problem in training_problems(config):
        raise ConfigError(problem)


def context_problem(max_tokens: int, context: int, said: str, note: str = "") -> str | None:
    """Why `sampling.max_tokens` cannot fit a context of `context` tokens (`said`: how to name
    it; `note`: what else to say), or None."""
    if max_tokens < context:
        return None
    return (
        f"sampling.max_tokens: {max_tokens} completion tokens leave no room for a prompt in "
        f"engine.max_model_len = {said} (prompt + completion{note}); lower the one or raise the other"
    )


SAMPLE_BYTES = 56 * 1024
"""Memory one sample in flight holds besides its tokens (its task, the engine's request, its
record), and `TOKEN_BYTES` more per completion token: rounded up from the tiny preset's peak
memory (all processes) with 8,192 samples of 16 tokens and 4,096 of 256 tokens in flight
(about 52 KB + 117 bytes per token)."""
TOKEN_BYTES = 128


def in_flight_samples(config: Config) -> int:
    """The most samples started and not yet trained: the capacity rule lets (max_lag + 1) steps'
    samples start ahead of the trainer."""
    run = config.run
    return (run.max_lag + 1) * run.groups_per_step * config.rollout.group_size


CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")
"""Where a container's memory limit is read (cgroup v2, then v1)."""


def machine_memory(limits: tuple[str, ...] = CGROUP_LIMITS) -> int:
    """The memory this process may use, in bytes: the machine's physical memory, or its
    container's limit where that is lower."""
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    for path in limits:
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            memory = min(memory, int(text))
    return memory


def memory_problem(config: Config, memory_bytes: int) -> str | None:
    """Why the samples the run keeps in flight cannot fit in half of `memory_bytes`, or None."""
    budget = config.completion_budget
    samples = in_flight_samples(config)
    needed = samples * (SAMPLE_BYTES + budget * TOKEN_BYTES)
    if needed <= memory_bytes // 2:
        return None
    gib = 1024**3
    return (
        f"rollout.group_size: {config.rollout.group_size} samples per group with run.groups_per_step = "
        f"{config.run.groups_per_step} and run.max_lag = {config.run.max_lag} keep up to {samples:,} samples in "
        f"flight, about {needed / gib:.1f} GiB at {budget} tokens each, more than half of the "
        f"{memory_bytes / gib:.1f} GiB this machine gives it; lower rollout.group_size, run.groups_per_step or "
        "run.max_lag"
    )


def training_problems(config: Config, memory_bytes: int | None = None) -> list[str]:
    """What `check_training` refuses, one message per problem (`memory_bytes`: the machine's
    memory to size the samples in flight against; default: this machine's)."""
    engine, loss, lora = config.engine, config.loss, config.trainer.lora
    problems = []
    problem = memory_problem(config, machine_memory() if memory_bytes is None else memory_bytes)
    if problem:
        problems.append(problem)
    if config.sampling.temperature <= 0:
        problems.append(
            "sampling.temperature: training samples need a temperature > 0 (0 is greedy decoding, which has "
            "no distribution to compute importance ratios against); greedy is only for `generate` and evaluation"
        )
    # 0: the model's own limit, at most CONTEXT_CAP; checked against the model when the run starts.
    said = f"{engine.max_model_len}" if engine.max_model_len else f"0, the model's own limit and at most {CONTEXT_CAP}"
    problem = context_problem(config.sampling.max_tokens, engine.max_model_len or CONTEXT_CAP, said)
    if problem:
        problems.append(problem)
    if config.data.paths and _kind(config) not in ("files", None):
        problems.append(
            f'data.paths: files are read only by data.task = "jsonl" (any dataset file), but the task is '
            f'{config.data.task!r}; set data.task = "jsonl" or remove data.paths'
        )
    problems += episode_problems(config)
    if loss.is_mode in ("mis", "seq_mis") and loss.is_low >= loss.is_high:
        problems.append(
            f"loss.is_low: the kept ratio range [{loss.is_low}, {loss.is_high}] of is_mode = {loss.is_mode!r} is "
            "empty (loss.is_low must be below loss.is_high): every token would be masked"
        )
    if lora.enabled and 0 < engine.max_loras < config.run.max_lag + 2:
        problems.append(
            f"engine.max_loras: {engine.max_loras} adapters cannot hold every version still in use with "
            f"run.max_lag = {config.run.max_lag} (at least max_lag + 2 = {config.run.max_lag + 2}; 0 picks that)"
        )
    budget = config.completion_budget
    if config.rollout.overlong == "soft" and not 0 < config.rollout.overlong_buffer < budget:
        problems.append(
            f'rollout.overlong_buffer: the "soft" penalty needs a buffer between 1 and the token budget - 1 '
            f"({budget - 1}); got {config.rollout.overlong_buffer}"
        )
    if config.run.eval_every and not config.run.eval_prompts:
        problems.append("run.eval_every: evaluating during training needs held-out prompts (run.eval_prompts > 0)")
    if config.run.eval_pass_k and not config.run.eval_prompts:
        problems.append("run.eval_pass_k: pass@k is measured on the held-out prompts (run.eval_prompts > 0)")
    if config.run.weight_transport == "nccl" and engine.weight_transfer != "nccl":
        problems.append('run.weight_transport: "nccl" needs the engine started with engine.weight_transfer = "nccl"')
    return problems


def _kind(config: Config) -> str | None:
    """The kind of `data.task` (None: not a task, which `check_task` reports)."""
    try:
        return parse_task(config.data).kind
    except ConfigError:
        return None


CHARS_PER_TOKEN_MAX = 32
"""More characters than any tokenizer puts in one token on average: a prompt longer than this
many characters per token of the context cannot fit it, whatever the tokenizer."""


def check_task(config: Config) -> Task:
    """The run's task (`data.task` parsed), refused now, before anything heavy starts, when it
    names no task, when `data.task_config` is given to a task that does not read it, when a
    reasoning-gym dataset refuses its settings or can make no item with them, or when its first
    prompt cannot fit the context by its length alone. Every command that makes prompts calls it."""
    data = config.data
    task = parse_task(data)
    if data.task_config and task.kind != "reasoning_gym":
        raise ConfigError(
            'data.task_config: only read by reasoning-gym tasks (data.task = "reasoning_gym:NAME"), '
            f"but the task is {data.task!r}"
        )
    source = task.problems()
    if source is None:
        return task
    try:
        question = source(data.seed, 0).question
    except Exception:  # this item's problem: the run drops its prompt with the reason
        return task
    context = config.engine.max_model_len or CONTEXT_CAP
    if len(question) > context * CHARS_PER_TOKEN_MAX:
        field = "data.task_config" if task.kind == "reasoning_gym" else "data.task"
        raise ConfigError(
            f"{field}: {data.task!r} makes prompts of {len(question):,} characters (its first), more than a "
            f"context of {context:,} tokens (engine.max_model_len) can hold; make its problems smaller"
        )
    return task


def episode_problems(config: Config) -> list[str]:
    """What cannot work in the episode settings (`[env]`): raw prompts, an OpenEnv source with
    both or neither of its server settings, evaluation that cannot apply. (A dataset beside a
    source that brings its own prompts is refused once the source exists: `controller.setup`.)"""
    env, problems = config.env, list[str]()
    if env is None:
        return problems
    kind = env.__struct_config__.tag
    if config.data.template == "raw":
        problems.append(
            'data.template: environments and agents render conversations with the chat template; "raw" prompts '
            f"cannot be used with [env] kind = {kind!r}"
        )
    if isinstance(env, OpenEnvConfig) and bool(env.url) == bool(env.server):
        problems.append(
            'env.url: kind = "openenv" needs the server\'s address (env.url) or the app rollflow serves '
            "(env.server), one of them"
        )
    if isinstance(env, EndpointConfig) and env.time_budget_s >= env.episode_timeout_s:
        problems.append(
            f"env.time_budget_s: {env.time_budget_s:g} s is not below env.episode_timeout_s "
            f"({env.episode_timeout_s:g} s), which ends the episode unscorable first; lower it or raise the timeout"
        )
    return problems
