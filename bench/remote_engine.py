"""Remote engine cost: the same concurrent rollouts through an in-process engine and through a
vLLM server driven over HTTP (`RemoteEngine`, the server started as `rollflow serve-engine`
starts it), alternating for several rounds in one run.

Both sample the same number of tokens (ignore_eos, fixed max_tokens) and return each token's
log-prob and version. Prints a table and, last, `RESULT remote_vs_inprocess=<x>` (median over
rounds of remote tokens/s divided by in-process tokens/s; 1.0 = no cost). On a 2-core machine
the server's API process, its engine process and this client share the cores, so the figure
includes that contention as well as HTTP streaming.

    bin/dev python bench/remote_engine.py [--requests 32] [--tokens 128] [--rounds 6]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import subprocess
import sys

from sidebyside import alternate, engine_args, report, workload

from rollflow.config import EngineConfig
from rollflow.engine.remote import RemoteEngine
from rollflow.engine.vllm import VLLMEngine
from rollflow.models import resolve_model
from rollflow.records import Prompt, SamplingSpec
from rollflow.rollout import rollout
from rollflow.testing import unused_port


async def round_of(engine, prompts: list[list[int]], spec: SamplingSpec, tag: str) -> int:
    samples = await asyncio.gather(
        *(
            rollout(engine, Prompt(id=f"p{i}", token_ids=p), spec, group_id=f"{tag}-{i}", index=0)
            for i, p in enumerate(prompts)
        )
    )
    return sum(s.num_tokens for s in samples)


def start_server(config: EngineConfig, model: str) -> tuple[subprocess.Popen, str]:
    port = unused_port()
    command = [sys.executable, "-m", "rollflow", "serve-engine", "--port", str(port),
               "--set", f'model.path="{model}"', "--set", f"engine.max_num_seqs={config.max_num_seqs}"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    return process, f"http://127.0.0.1:{port}"


async def main(args: argparse.Namespace) -> None:
    config = EngineConfig(max_num_seqs=max(args.requests, 16))
    process, url = start_server(config, args.model)
    local = VLLMEngine(resolve_model(args.model), config)
    remote = RemoteEngine(url, config)
    try:
        await asyncio.gather(local.start(), remote.start())
        prompts, spec = workload(args)
        for engine in (local, remote):
            await round_of(engine, prompts[:4], spec, "warmup")
        totals, ratios = await alternate(
            [
                ("in-process", lambda tag: round_of(local, prompts, spec, tag)),
                ("remote (HTTP)", lambda tag: round_of(remote, prompts, spec, tag)),
            ],
            args.rounds,
        )
    finally:
        await remote.aclose()
        await local.aclose()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        process.wait(60)
    report(totals, ratios, args, "remote_vs_inprocess")


if __name__ == "__main__":
    asyncio.run(main(engine_args(__doc__)))
