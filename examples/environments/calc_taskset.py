"""A verifiers v1 taskset whose tasks come with tools, written as verifiers 0.3+ writes them: a
`vf.Toolset` of `@vf.tool` methods that each task launches (`Task.toolsets`).

`CalcTaskset` yields `n` tasks "What is a × b + c?" (`CalcConfig`: `n`, `seed`). Each `CalcTask`
has the `Calculator` toolset (`calculator_add`, `calculator_multiply`, as verifiers' harnesses name
them) and scores a trace with two `@vf.reward`s (`correct`, weight 1: the last number of the reply
is the answer; `used_tools`, weight 0.25: the share of its turns that called a tool and got a
result without an error) and a `@vf.metric` (`tool_calls`). Loaded by id (`[env] kind =
"verifiers"`, `taskset = "calc-taskset"`) with this folder on sys.path, as an installed taskset
package would be; examples/verifiers_tools.py trains it. verifiers would run `Calculator` as an MCP
server program (this module, run: the block at its end); rollflow serves it in-process, also to
the episodes of an `Env` that plays the taskset (`env.env_id`), since its config is a field of the
task's config (`CalcTaskConfig.tools`).
"""

from __future__ import annotations

import random
import re

import verifiers.v1 as vf


class CalculatorConfig(vf.ToolsetConfig):
    pass


class Calculator(vf.Toolset[CalculatorConfig, vf.State]):
    @vf.tool
    async def add(self, a: int, b: int) -> str:
        """Add two integers."""
        return str(a + b)

    @vf.tool
    async def multiply(self, a: int, b: int) -> str:
        """Multiply two integers."""
        return str(a * b)


class CalcData(vf.TaskData):
    answer: int


class CalcTaskConfig(vf.TaskConfig):
    tools: CalculatorConfig = CalculatorConfig()


class CalcTask(vf.Task[CalcData, vf.State, CalcTaskConfig]):
    @classmethod
    def toolsets(cls, config: CalcTaskConfig) -> list[vf.Toolset]:
        return [Calculator(config.tools)]

    @vf.reward(weight=1.0)
    async def correct(self, task: CalcData, trace: vf.Trace) -> float:
        found = re.findall(r"-?\d+", trace.last_reply)
        return 1.0 if found and int(found[-1]) == task.answer else 0.0

    @vf.reward(weight=0.25)
    async def used_tools(self, trace: vf.Trace) -> float:
        results = [m for m in trace.tool_messages if not str(m.content).startswith("error")]
        return len(results) / max(trace.num_turns, 1)

    @vf.metric
    async def tool_calls(self, trace: vf.Trace) -> float:
        return float(len(trace.tool_messages))


class CalcConfig(vf.TasksetConfig):
    n: int = 32
    seed: int = 0
    task: CalcTaskConfig = CalcTaskConfig()


class CalcTaskset(vf.Taskset[CalcTask, CalcConfig]):
    def load(self):
        rng = random.Random(self.config.seed)
        for i in range(self.config.n):
            a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(2, 99)
            data = CalcData(
                idx=i,
                prompt=f"What is {a} × {b} + {c}?",
                system_prompt="Use the calculator tools, then answer with the number.",
                answer=a * b + c,
            )
            yield CalcTask(data, self.config.task)


__all__ = ["CalcTaskset"]


if __name__ == "__main__":
    Calculator.run()
