"""A verifiers v1 taskset written the way verifiers 0.3+ and prime-rl write them: typed tasks
that score themselves.

`SumsTaskset` yields `n` tasks "What is a + b?" (`SumsConfig`: `n`, `seed`); each `SumTask`
carries its answer in its data and scores a trace with two `@vf.reward`s (`correct`, weight 1:
the last number of the reply is the sum; `digits`, weight 0.5: the share of digits in the reply, a
signal even a tiny random model can climb) and one `@vf.metric` (`reply_chars`). Loaded by id
(`[env] kind = "verifiers"`, `taskset = "sums-taskset"`) with this folder on sys.path, as an
installed taskset package would be; examples/verifiers_taskset.py trains it.
"""

from __future__ import annotations

import random
import re

import verifiers.v1 as vf


class SumData(vf.TaskData):
    answer: int


class SumTask(vf.Task[SumData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def correct(self, task: SumData, trace: vf.Trace) -> float:
        found = re.findall(r"-?\d+", trace.last_reply)
        return 1.0 if found and int(found[-1]) == task.answer else 0.0

    @vf.reward(weight=0.5)
    async def digits(self, trace: vf.Trace) -> float:
        text = trace.last_reply
        return sum(c.isdigit() for c in text) / len(text) if text else 0.0

    @vf.metric
    async def reply_chars(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply))


class SumsConfig(vf.TasksetConfig):
    n: int = 32
    seed: int = 0


class SumsTaskset(vf.Taskset[SumTask, SumsConfig]):
    def load(self):
        rng = random.Random(self.config.seed)
        for i in range(self.config.n):
            a, b = rng.randint(0, 9), rng.randint(0, 9)
            data = SumData(idx=i, prompt=f"What is {a} + {b}?", system_prompt="Answer with a number.", answer=a + b)
            yield SumTask(data, self.config.task)


__all__ = ["SumsTaskset"]
