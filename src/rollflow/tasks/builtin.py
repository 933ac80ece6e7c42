"""The built-in procedural tasks, `arithmetic` and `countdown`, and their verifiers.

`arithmetic` asks for a + b (or a - b, a * b); `countdown` asks for an expression over given
numbers that reaches a target. Each task turns an index into the same problem on every run, so
prompt ids are stable without any stored data. Verifiers are pure functions from a completion's
text to 1.0 / 0.0. This module does no tokenising and no sampling order; see `sampler`.
"""

from __future__ import annotations

import ast
import operator
import random
import re
from collections.abc import Callable
from typing import Any

from rollflow.tasks.task import Problem, ProblemSource, Task, TaskKind

_LAST_INT = re.compile(r"-?\d+")


def arithmetic_problem(seed: int, index: int, max_operand: int = 20) -> Problem:
    """Problem `index` of the arithmetic task: integer +, - or * of two operands."""
    rng = random.Random(f"arithmetic:{seed}:{index}")
    a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
    op = rng.choice("+-*") if max_operand <= 12 else rng.choice("++-")
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    return Problem(f"What is {a} {op} {b}?", str(value), {"a": a, "b": b, "op": op})


def last_integer(text: str) -> str | None:
    """The last integer written in `text`, or None."""
    found = _LAST_INT.findall(text)
    return found[-1] if found else None


def arithmetic_reward(completion: str, answer: str) -> float:
    """1.0 when the last integer in the completion equals the answer."""
    return 1.0 if last_integer(completion) == answer else 0.0


COUNTDOWN_NUMBERS = 4
"""How many numbers a countdown problem gives."""


def countdown_problem(seed: int, index: int, max_operand: int = 20) -> Problem:
    """Problem `index` of countdown: reach a target with + - * over the numbers, each used once.

    The target is built from a random expression over the numbers, so a solution exists.
    """
    rng = random.Random(f"countdown:{seed}:{index}")
    numbers = [rng.randint(1, max_operand) for _ in range(COUNTDOWN_NUMBERS)]
    target = numbers[0]
    for n in numbers[1:]:
        target = rng.choice([target + n, target - n, target * n]) if target < 200 else target - n
    question = (
        f"Using the numbers {numbers}, each exactly once, with + - * and parentheses, "
        f"make {target}. Answer with the expression only."
    )
    return Problem(question, str(target), {"numbers": numbers, "target": target})


_OPS: dict[type, Callable[[int, int], int]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
}


def _evaluate(node: ast.AST, used: list[int]) -> int:
    """Evaluate + - * over integer literals only; anything else raises ValueError."""
    if isinstance(node, ast.Expression):
        return _evaluate(node.body, used)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_evaluate(node.left, used), _evaluate(node.right, used))
    if isinstance(node, ast.Constant) and type(node.value) is int:
        used.append(node.value)
        return node.value
    raise ValueError("not a + - * expression over integers")


def evaluate_expression(text: str) -> int:
    """Value of an expression of + - * over integers and parentheses; ValueError otherwise."""
    try:
        return _evaluate(ast.parse(text.strip(), mode="eval"), [])
    except (SyntaxError, RecursionError) as err:
        raise ValueError(f"not an arithmetic expression: {text!r}") from err


def countdown_reward(completion: str, numbers: list[int], target: int) -> float:
    """1.0 when the last line of the completion is an expression that uses exactly the given
    numbers and evaluates to the target."""
    lines = [line.strip() for line in completion.strip().splitlines() if line.strip()]
    if not lines:
        return 0.0
    expression = lines[-1].split("=")[0].strip().rstrip(".")
    try:
        used: list[int] = []
        value = _evaluate(ast.parse(expression, mode="eval"), used)
    except (SyntaxError, ValueError, RecursionError):
        return 0.0
    return 1.0 if value == target and sorted(used) == sorted(numbers) else 0.0


PROBLEMS: dict[str, Callable[[int, int, int], Problem]] = {
    "arithmetic": arithmetic_problem,
    "countdown": countdown_problem,
}
"""Built-in procedural tasks by name: (seed, index, max_operand) -> Problem."""


class BuiltinTask(Task):
    """`arithmetic` or `countdown` (`rollflow.tasks.builtin`)."""

    kind: TaskKind = "builtin"

    def __init__(self, name: str, max_operand: int = 20) -> None:
        super().__init__(name)
        self.max_operand = max_operand

    def problems(self) -> ProblemSource:
        make = PROBLEMS[self.name]
        return ProblemSource(lambda seed, index: make(seed, index, self.max_operand))

    def verify(self, completion: str, answer: str | None, metadata: dict[str, Any]) -> float:
        if self.name == "countdown":
            return countdown_reward(completion, metadata["numbers"], metadata["target"])
        return super().verify(completion, answer, metadata)
