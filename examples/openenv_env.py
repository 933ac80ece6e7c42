"""Train against an OpenEnv environment (TRL's standard), through its own server and client.

    bin/dev python examples/openenv_env.py              # rollflow starts the server itself
    bin/dev python examples/openenv_env.py --url URL    # a server already running there

examples/environments/openenv_sums.py is an ordinary OpenEnv environment: an `Environment` on the
server side (reset asks "What is a + b?", each step judges an answer and says "Try again" once),
the ASGI `app` that OpenEnv's `create_app` makes, and an `EnvClient` subclass. rollflow serves the
app with uvicorn on 127.0.0.1 (`env.openenv_server`), or connects to `--url`; every episode opens
its own session: reset, then one step per model turn, the observation as the next user message
and the server's reward as the turn's. Start a server yourself with
`cd examples/environments && python -m uvicorn openenv_sums:app --port 8000`.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import rollflow

HERE = Path(__file__).resolve().parent


async def main(url: str | None) -> None:
    sys.path.insert(0, str(HERE / "environments"))  # where the example environment lives
    server = [f"env.url={url}"] if url else ["env.server=openenv_sums:app"]
    config = rollflow.load_config(
        preset="tiny",
        overrides=["env.kind=openenv", "env.client=openenv_sums:SumsClient", *server, "env.max_turns=2",
                   "env.max_tokens=64", "run.max_steps=6", "observe.sinks=[]"],
    )
    output_dir = rollflow.new_run_dir("openenv")  # runs/openenv-<date>-<time>, new each time
    result = await rollflow.train(config, output_dir, on_step=lambda m: print(
        f"step {m['step'] + 1}: reward {m['reward_mean']:.3f}  turns {m['turns_mean']:.2f}"
    ))
    print(f"{result.steps} steps, {result.trained_prompts} prompts trained, dropped {result.dropped}; in {output_dir}")


if __name__ == "__main__":  # vLLM spawns processes and uvicorn runs in its own: keep the guard
    args = sys.argv[1:]
    asyncio.run(main(args[args.index("--url") + 1] if "--url" in args else None))
