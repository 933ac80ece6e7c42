"""Train the tiny model against a reward server over HTTP, in one command.

    bin/dev python examples/remote_reward.py

Starts the reference server (`examples/reward_server.py`) on 127.0.0.1 in this process, then
trains with `scoring.rewards = [{name = "arith", url = ...}]`: the server returns 1.0 for a
completion whose last number is the answer, 0.0 for a wrong number and null (unscorable) for no
number at all. The random tiny model writes wrong numbers (0.0) and now and then no number: that
completion is unscorable, counted under `unscorable_by_reason`, never scored 0. Run the server
alone with `python examples/reward_server.py --port 8000` to point other runs at it.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from aiohttp import web

import rollflow

sys.path.insert(0, str(Path(__file__).parent))
from reward_server import make_app


async def main() -> None:
    runner = web.AppRunner(make_app())
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    port = runner.addresses[0][1]
    try:
        config = rollflow.load_config(
            preset="tiny",
            overrides=[
                "run.max_steps=4",
                "data.task=arithmetic",
                f'scoring.rewards=[{{name="arith", url="http://127.0.0.1:{port}/score", timeout_s=5}}]',
            ],
        )
        output_dir = rollflow.new_run_dir("remote_reward")  # runs/remote_reward-<date>-<time>, new each time
        result = await rollflow.train(config, output_dir)
    finally:
        await runner.cleanup()
    print(f"trained prompts: {result.trained_prompts}, dropped: {result.dropped}; the run is in {output_dir}")
    for row in result.metrics:
        print(f"step {row['step']}: arith {row['rewards'].get('arith')}, unscorable {row['unscorable_by_reason']}")


if __name__ == "__main__":  # vLLM spawns processes: keep the guard
    asyncio.run(main())
