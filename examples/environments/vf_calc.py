"""A multi-turn verifiers environment with a tool: `ToolEnv` with an `add` tool.

The model may call `add(a, b)` (Hermes `<tool_call>` format through the OpenAI API); the tool's
result comes back as a tool message, and the rubric checks the final reply's last number.
Loaded by name (`[env] kind = "verifiers"`, `environment = "vf-calc"`) with this folder on sys.path.
"""

from __future__ import annotations

import random
import re

import verifiers as vf
from datasets import Dataset


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first number
        b: the second number
    """
    return a + b


def load_environment(n: int = 16, max_turns: int = 3) -> vf.Environment:
    rng = random.Random(1)
    rows = []
    for _ in range(n):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        rows.append({"question": f"What is {a} + {b}? Use the add tool.", "answer": str(a + b)})

    def correct(completion, answer, **kwargs) -> float:
        replies = [m for m in completion if m["role"] == "assistant"] if isinstance(completion, list) else []
        text = (replies[-1]["content"] or "") if replies else ""
        found = re.findall(r"-?\d+", text)
        return 1.0 if found and found[-1] == answer else 0.0

    return vf.ToolEnv(
        dataset=Dataset.from_list(rows), tools=[add], max_turns=max_turns, rubric=vf.Rubric(funcs=[correct])
    )
