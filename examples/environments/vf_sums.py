"""A verifiers environment written the way prime-rl's are: single turn over a local dataset.

`load_environment(n=32)`: "What is a + b?" rows, scored by a rubric function that checks the
last number of the reply (and, at half weight, the share of digits in it: a signal even a tiny
random model can climb). Loaded by name (`[env] kind = "verifiers"`, `environment = "vf-sums"`) with this folder on
sys.path, as an installed environment package would be; examples/verifiers_env.py trains it.
"""

from __future__ import annotations

import random
import re

import verifiers as vf
from datasets import Dataset


def last_number(text: str) -> str | None:
    found = re.findall(r"-?\d+", text)
    return found[-1] if found else None


def load_environment(n: int = 32, seed: int = 0) -> vf.Environment:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        rows.append({"question": f"What is {a} + {b}?", "answer": str(a + b)})

    def correct(completion, answer, **kwargs) -> float:
        text = completion[-1]["content"] if isinstance(completion, list) else completion
        return 1.0 if last_number(text or "") == answer else 0.0

    def digits(completion, **kwargs) -> float:
        """A smooth signal a tiny random model can climb: the share of digits in the reply."""
        text = (completion[-1]["content"] if isinstance(completion, list) else completion) or ""
        return sum(c.isdigit() for c in text) / len(text) if text else 0.0

    rubric = vf.Rubric(funcs=[correct, digits], weights=[1.0, 0.5])
    return vf.SingleTurnEnv(dataset=Dataset.from_list(rows), system_prompt="Answer with a number.", rubric=rubric)
