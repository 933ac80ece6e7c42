"""Procedural tasks: prompts generated from (seed, index), and the verifier of each task.

`data.task` names one: a built-in (`arithmetic`, `countdown`: `rollflow.tasks.builtin`) or any
reasoning-gym dataset (`reasoning_gym:NAME`: `rollflow.tasks.reasoning_gym`). `problem_source`
gives the function that makes problem `index` of the stream with seed `seed`; `verify` scores a
completion of a prompt with its task's checker (rows of dataset files without one are compared
with their `answer`). This module does no tokenising and no sampling order; see `sampler`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rollflow.errors import ConfigError
from rollflow.tasks.builtin import (
    PROBLEMS,
    Problem,
    arithmetic_problem,
    arithmetic_reward,
    countdown_problem,
    countdown_reward,
    evaluate_expression,
    last_integer,
)
from rollflow.tasks.reasoning_gym import PREFIX as REASONING_GYM

if TYPE_CHECKING:
    from rollflow.config import DataConfig

__all__ = [
    "PROBLEMS",
    "REASONING_GYM",
    "Problem",
    "ProblemSource",
    "arithmetic_problem",
    "arithmetic_reward",
    "check_source",
    "countdown_problem",
    "countdown_reward",
    "evaluate_expression",
    "last_integer",
    "problem_source",
    "verify",
]

FILES = "jsonl"
"""The `data.task` that reads dataset files instead of generating prompts."""


class ProblemSource:
    """A procedural task: problem `index` of the stream with seed `seed`, and the system prompt
    its prompts get when `data.system_prompt` is empty. `prepare(seed, index)` does the slow
    part of making that problem ahead, on any thread (a no-op for tasks that make problems in
    microseconds)."""

    def __init__(
        self,
        make: Callable[[int, int], Problem],
        system_prompt: str = "",
        prepare: Callable[[int, int], None] | None = None,
    ) -> None:
        self.make = make
        self.system_prompt = system_prompt
        self.prepare = prepare or (lambda seed, index: None)
        self.slow = prepare is not None
        """Making a problem can take long enough to stall an event loop (`prepare` it on a thread)."""

    def __call__(self, seed: int, index: int) -> Problem:
        return self.make(seed, index)


def problem_source(config: DataConfig) -> ProblemSource:
    """The procedural task `data.task` names; ConfigError for an unknown one (naming close names)."""
    task = config.task
    if task in PROBLEMS:
        make = PROBLEMS[task]
        return ProblemSource(lambda seed, index: make(seed, index, config.max_operand))
    if task.startswith(REASONING_GYM):
        from rollflow.tasks.reasoning_gym import task_for

        source = task_for(task, config.task_config, config.answer_from)
        return ProblemSource(source.problem, source.system_prompt, source.prepare)
    raise ConfigError(f"data.task: {task!r} is not a task; {TASK_FORMS}")


TASK_FORMS = (
    f"expected {', '.join(repr(t) for t in PROBLEMS)}, 'reasoning_gym:NAME' (a reasoning-gym dataset) "
    f"or {FILES!r} (dataset files in data.paths)"
)
"""What `data.task` accepts, for error messages."""


CHARS_PER_TOKEN_MAX = 32
"""More characters than any tokenizer puts in one token on average: a prompt longer than this
many characters per token of the context cannot fit it, whatever the tokenizer."""


def check_source(config: DataConfig, context_tokens: int | None = None) -> None:
    """ConfigError now, before anything heavy starts, when `data.task` names a procedural task
    that does not exist, settings it refuses, or settings whose first prompt cannot fit
    `context_tokens` (`engine.max_model_len`; None: not checked) by its length alone (dataset
    files are read by the sampler)."""
    if config.task == FILES:
        return
    source = problem_source(config)
    if context_tokens is None:
        return
    try:
        question = source(config.seed, 0).question
    except Exception:  # this item's problem: the run drops its prompt with the reason
        return
    if len(question) > context_tokens * CHARS_PER_TOKEN_MAX:
        field = "data.task_config" if config.task.startswith(REASONING_GYM) else "data.task"
        raise ConfigError(
            f"{field}: {config.task!r} makes prompts of {len(question):,} characters (its first), more than a "
            f"context of {context_tokens:,} tokens (engine.max_model_len) can hold; make its problems smaller"
        )


def check_task(task: str) -> None:
    """ConfigError unless `task` has one of the forms `data.task` accepts (the dataset a
    `reasoning_gym:NAME` names is checked when its prompts are made)."""
    if task in PROBLEMS or task == FILES or (task.startswith(REASONING_GYM) and len(task) > len(REASONING_GYM)):
        return
    import difflib

    close = difflib.get_close_matches(task, [*PROBLEMS, FILES], n=2, cutoff=0.6)
    hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    raise ConfigError(f"data.task: {task!r} is not a task{hint} ({TASK_FORMS})")


def verify(task: str, completion: str, answer: str | None, metadata: dict[str, Any]) -> float:
    """Score a completion with the verifier of its task."""
    if task == "arithmetic" and answer is not None:
        return arithmetic_reward(completion, answer)
    if task == "countdown":
        return countdown_reward(completion, metadata["numbers"], metadata["target"])
    if task.startswith(REASONING_GYM):
        from rollflow.tasks.reasoning_gym import score

        return score(task, completion, metadata)
    if answer is not None:
        return (
            arithmetic_reward(completion, answer)
            if answer.lstrip("-").isdigit()
            else float(completion.strip() == answer.strip())
        )
    raise ValueError(f"task {task!r} has no verifier and the prompt has no answer")
