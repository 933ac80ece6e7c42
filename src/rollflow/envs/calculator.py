"""The calculator environment: arithmetic questions, a calculator tool the model may call.

Each model turn either calls the tool (Hermes-style `<tool_call>` JSON, see `envs.tools`), and
the episode goes on with the result as a `tool` message, or answers: then the episode ends with
reward 1.0 when the turn's last integer is the prompt's answer (the task's verifier), else 0.0.
A turn cut off by the token budget ends the episode the same way. Any task with integer answers
works; the arithmetic task is the one it is made for. This module does not tokenise.
"""

from __future__ import annotations

from rollflow.envs import EnvStep, Turn
from rollflow.envs.tools import Tool, call_tool, parse_tool_calls
from rollflow.records import Message, Prompt
from rollflow.tasks import evaluate_expression, verify

SYSTEM = (
    "You can use a calculator. To call it, write\n"
    '<tool_call>{"name": "calculator", "arguments": {"expression": "3 * (4 + 5)"}}</tool_call>\n'
    "and its result comes back to you. Give the final answer as a number, without a tool call."
)


def calculator(expression: str) -> str:
    """Evaluate + - * over integers and parentheses."""
    return str(evaluate_expression(expression))


class CalculatorEnv:
    """One arithmetic episode with a calculator tool."""

    def __init__(self, *, tool_timeout_s: float = 5.0, tools: dict[str, Tool] | None = None) -> None:
        self.tool_timeout_s = tool_timeout_s
        self.tools = tools if tools is not None else {"calculator": calculator}
        self.prompt: Prompt | None = None
        self.tool_calls = 0

    async def reset(self, prompt: Prompt) -> list[Message]:
        self.prompt = prompt
        return [Message(role="system", content=SYSTEM)] + [m for m in prompt.messages if m.role != "system"]

    async def step(self, turn: Turn) -> EnvStep:
        assert self.prompt is not None, "reset() comes first"
        calls, error = parse_tool_calls(turn.text)
        if turn.finish_reason == "length" or (not calls and error is None):
            prompt = self.prompt
            return EnvStep(reward=verify(prompt.task, turn.text, prompt.answer, prompt.metadata), done=True)
        results = [await call_tool(self.tools, call, self.tool_timeout_s) for call in calls]
        self.tool_calls += len(calls)
        if error is not None:
            results.append(error)
        return EnvStep(messages=[Message(role="tool", content=result) for result in results])
