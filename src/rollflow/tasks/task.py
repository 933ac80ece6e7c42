"""The `Task` seam: what every task gives the run (its kind, its stream of problems, its
verifier), and the dataset-files task, which is the base behaviour. Subclasses: `BuiltinTask`
(`rollflow.tasks.builtin`) and `ReasoningGym` (`rollflow.tasks.reasoning_gym`); `parse_task`
(`rollflow.tasks`) chooses one. This module makes no problems itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

FILES = "jsonl"
"""The `data.task` that reads dataset files instead of generating prompts."""

TaskKind = Literal["builtin", "files", "reasoning_gym"]


@dataclass(frozen=True)
class Problem:
    """One generated problem: the user message, the reference answer, extra columns."""

    question: str
    answer: str
    metadata: dict[str, Any]


class ProblemSource:
    """A procedural task's stream: problem `index` of the stream with seed `seed`, and the system
    prompt its prompts get when `data.system_prompt` is empty. `prepare(seed, index)` does the slow
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


class Task:
    """A task as `data.task` names it. This base is the dataset-files task: no stream of its own,
    each completion compared with its row's `answer` (the last integer for a numeric answer, the
    stripped text otherwise)."""

    kind: TaskKind = "files"
    slow_checker = False
    """Its checker may take long (it runs on a thread with the reward's timeout)."""
    held_out_items = 0
    """Items of its stream, from `run.eval_seed` on, held out for evaluation (never trained)."""

    def __init__(self, name: str = FILES) -> None:
        self.name = name

    def problems(self) -> ProblemSource | None:
        """The stream of problems; None for dataset files (the sampler reads them)."""
        return None

    def verify(self, completion: str, answer: str | None, metadata: dict[str, Any]) -> float:
        """1.0 for a right completion, 0.0 for a wrong one (or the task's own partial credit);
        ValueError when it cannot be checked."""
        if answer is None:
            raise ValueError(f"task {self.name!r} has no verifier and the prompt has no answer")
        if answer.lstrip("-").isdigit():
            from rollflow.tasks.builtin import arithmetic_reward  # (builtin imports this module)

            return arithmetic_reward(completion, answer)
        return float(completion.strip() == answer.strip())

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"
