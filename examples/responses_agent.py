"""Train an agent written only against OpenAI's Responses API: a calculator tool, state on the server.

    bin/dev python examples/responses_agent.py

`agent` below knows nothing of rollflow: it gets a task and a `base_url` and talks to it with the
`openai` client's Responses API, keeping the conversation on the server (`previous_response_id`):
`function_call` items in, `function_call_output` items out. rollflow serves that API from the
run's own engine and records every reply token by token (with the version of the weights that
computed it); the tool results are in the sequence but not in the loss. The agent's return value
is the episode's reward.

The tiny model has random weights: it almost never writes a well-formed tool call or the right
answer, so the printout shows the mechanics (calls per episode, tool calls, the reward), not a
skill. With `--preset default` and a model that can call tools, the same agent learns.
"""

from __future__ import annotations

import asyncio
import json
import re
import sys

from openai import AsyncOpenAI

import rollflow

TOOLS = [
    {
        "type": "function",
        "name": "calculator",
        "description": "Evaluate an arithmetic expression over integers: + - * and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    }
]
INSTRUCTIONS = "Answer with a number. You may call the calculator tool first."
STATS = {"episodes": 0, "calls": 0, "tool_calls": 0}


def calculator(expression: str) -> str:
    if not re.fullmatch(r"[0-9+\-*() ]+", expression):
        return "error: only integers, + - * and parentheses"
    try:
        return str(eval(expression))  # the pattern above admits arithmetic only
    except SyntaxError:
        return "error: not an expression"


async def agent(task: rollflow.AgentTask, base_url: str) -> float:
    """Ask, run the function calls, send their outputs after the previous response, until it answers."""
    client = AsyncOpenAI(base_url=base_url, api_key="not-needed")
    answer = ""
    async with client:
        reply = await client.responses.create(model=task.model, instructions=INSTRUCTIONS, input=task.prompt,
                                              tools=TOOLS)
        for _ in range(3):
            STATS["calls"] += 1
            calls = [item for item in reply.output if item.type == "function_call"]
            if not calls:
                answer = reply.output_text
                break
            outputs = []
            for call in calls:
                STATS["tool_calls"] += 1
                try:
                    result = calculator(**json.loads(call.arguments))
                except (TypeError, json.JSONDecodeError) as err:
                    result = f"error: {err}"
                outputs.append({"type": "function_call_output", "call_id": call.call_id, "output": result})
            reply = await client.responses.create(model=task.model, instructions=INSTRUCTIONS, input=outputs,
                                                  previous_response_id=reply.id, tools=TOOLS)
    STATS["episodes"] += 1
    numbers = re.findall(r"-?\d+", answer)
    return 1.0 if numbers and numbers[-1] == task.answer else 0.0


async def main(preset: str) -> None:
    config = rollflow.load_config(
        preset=preset, overrides=["run.max_steps=4", "env.kind=agent", "env.max_turns=3", "env.max_tokens=96"]
    )
    output_dir = rollflow.new_run_dir(f"responses-agent-{preset}")  # new each time
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
