"""Train an agent written only against Anthropic's Messages API: a calculator tool in a tool-use loop.

    bin/dev python examples/anthropic_agent.py

`agent` below knows nothing of rollflow: it reads the run's URL and its episode's key from the
task (a program would read `ANTHROPIC_BASE_URL` and `ANTHROPIC_API_KEY` from `task.environ`) and
talks to it with the `anthropic` client: `tool_use` blocks in, `tool_result` blocks out. rollflow
serves the Messages API from the run's own engine and records every reply token by token (with the
version of the weights that computed it); the tool results are in the sequence but not in the loss.
The agent's return value is the episode's reward.

The tiny model has random weights: it almost never writes a well-formed tool call or the right
answer, so the printout shows the mechanics (calls per episode, tool calls, the reward), not a
skill. With `--preset default` and a model that can call tools, the same agent learns.
"""

from __future__ import annotations

import asyncio
import re
import sys

from anthropic import AsyncAnthropic

import rollflow

TOOLS = [
    {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression over integers: + - * and parentheses.",
        "input_schema": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    }
]
SYSTEM = "Answer with a number. You may call the calculator tool first."
STATS = {"episodes": 0, "calls": 0, "tool_calls": 0}


def calculator(expression: str) -> str:
    if not re.fullmatch(r"[0-9+\-*() ]+", expression):
        return "error: only integers, + - * and parentheses"
    try:
        return str(eval(expression))  # the pattern above admits arithmetic only
    except SyntaxError:
        return "error: not an expression"


async def agent(task: rollflow.AgentTask, base_url: str) -> float:
    """Call the model, run its tool_use blocks, send their results, until it answers in text."""
    client = AsyncAnthropic(base_url=task.endpoint, api_key=task.api_key)
    messages = [{"role": "user", "content": task.prompt}]
    answer = ""
    async with client:
        for _ in range(3):
            reply = await client.messages.create(model=task.model, max_tokens=64, system=SYSTEM, messages=messages,
                                                 tools=TOOLS)
            STATS["calls"] += 1
            messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]})
            uses = [block for block in reply.content if block.type == "tool_use"]
            if not uses:
                answer = "".join(block.text for block in reply.content if block.type == "text")
                break
            results = []
            for use in uses:
                STATS["tool_calls"] += 1
                expression = use.input.get("expression")
                result = calculator(expression) if isinstance(expression, str) else "error: give an expression"
                results.append({"type": "tool_result", "tool_use_id": use.id, "content": result})
            messages.append({"role": "user", "content": results})
    STATS["episodes"] += 1
    numbers = re.findall(r"-?\d+", answer)
    return 1.0 if numbers and numbers[-1] == task.answer else 0.0


async def main(preset: str) -> None:
    config = rollflow.load_config(
        preset=preset, overrides=["run.max_steps=4", "env.kind=agent", "env.max_turns=3", "env.max_tokens=96"]
    )
    output_dir = rollflow.new_run_dir(f"anthropic-agent-{preset}")  # new each time
    result = await rollflow.train(config, output_dir, agent=agent)
    for row in result.metrics:
        print(
            f"step {row['step']}: reward {row['reward_mean']:.3f}  calls per episode {row['turns_mean']:.2f}  "
            f"tokens {row['tokens']}  splits {row['agent_splits']}"
        )
    print(f"episodes {STATS['episodes']}, calls {STATS['calls']}, tool calls the model wrote {STATS['tool_calls']}")
    print(f"the run is in {output_dir}")


if __name__ == "__main__":  # vLLM spawns processes: keep the guard
    asyncio.run(main(sys.argv[2] if len(sys.argv) > 2 and sys.argv[1] == "--preset" else "tiny"))
