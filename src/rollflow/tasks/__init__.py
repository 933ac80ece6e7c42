"""Tasks: what `data.task` names, parsed once into a `Task` that makes and checks its problems.

`parse_task(data)` is the one place the string is read: a built-in procedural task (`arithmetic`,
`countdown`: `rollflow.tasks.builtin`), a reasoning-gym dataset (`reasoning_gym:NAME`:
`rollflow.tasks.reasoning_gym`) or dataset files (`jsonl`, read by the sampler). A `Task` says
its kind and name, makes problem `index` of the stream with seed `seed` (`problems`), verifies a
completion (`verify`), whether its checker is slow (it then runs on a thread) and how many items
of its stream are held out for evaluation. `task_named(name)` is the verifier of a prompt's own
task column (a dataset row may name any task; an unknown one is compared with its `answer`).
This module does no tokenising and no sampling order (`rollflow.sampler`), and does not decide
what a run refuses (`rollflow.checks`).
"""

from __future__ import annotations

import difflib
import functools
from typing import TYPE_CHECKING, Any

from rollflow.errors import ConfigError
from rollflow.tasks.builtin import (
    PROBLEMS,
    BuiltinTask,
    Problem,
    arithmetic_problem,
    arithmetic_reward,
    countdown_problem,
    countdown_reward,
    evaluate_expression,
    last_integer,
)
from rollflow.tasks.reasoning_gym import PREFIX as REASONING_GYM
from rollflow.tasks.task import FILES, ProblemSource, Task, TaskKind

if TYPE_CHECKING:
    from rollflow.config import DataConfig

__all__ = [
    "PROBLEMS",
    "Problem",
    "ProblemSource",
    "Task",
    "TaskKind",
    "arithmetic_problem",
    "arithmetic_reward",
    "countdown_problem",
    "countdown_reward",
    "evaluate_expression",
    "last_integer",
    "parse_task",
    "task_named",
    "verify",
]

TASK_FORMS = (
    f"expected {', '.join(repr(t) for t in PROBLEMS)}, 'reasoning_gym:NAME' (a reasoning-gym dataset) "
    f"or {FILES!r} (dataset files in data.paths)"
)
"""What `data.task` accepts, for error messages."""


def parse_task(data: DataConfig) -> Task:
    """The task `data.task` names, with its settings; ConfigError for a name that is none (naming
    close ones). Cheap: a reasoning-gym dataset is made when its problems are first needed."""
    name = data.task
    if name in PROBLEMS:
        return BuiltinTask(name, data.max_operand)
    if name == FILES:
        return Task()
    if name.startswith(REASONING_GYM) and len(name) > len(REASONING_GYM):
        from rollflow.tasks.reasoning_gym import ReasoningGym

        return ReasoningGym(name, data.task_config, data.answer_from)
    close = difflib.get_close_matches(name, [*PROBLEMS, FILES], n=2, cutoff=0.6)
    hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    raise ConfigError(f"data.task: {name!r} is not a task{hint} ({TASK_FORMS})")


@functools.lru_cache(maxsize=64)
def task_named(name: str) -> Task:
    """The verifier of a prompt whose task column says `name`: its task with default settings (a
    reasoning-gym prompt carries its item's settings in its metadata), or, for a name that is no
    task (a dataset row's own label), the comparison with the row's answer."""
    from rollflow.config import DataConfig

    try:
        return parse_task(DataConfig(task=name))
    except ConfigError:
        return Task(name)


def verify(task: str, completion: str, answer: str | None, metadata: dict[str, Any]) -> float:
    """Score a completion of a prompt of task `task` with that task's verifier."""
    return task_named(task).verify(completion, answer, metadata)
