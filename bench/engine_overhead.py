"""Engine overhead: the same concurrent requests through raw AsyncLLM and through rollflow.

Both paths share one engine process and one event loop, alternate for several rounds, and
generate the same number of tokens (ignore_eos, fixed max_tokens, sampled token's log-prob
returned on both). rollflow's path adds the Engine adapter (version spans, log-prob unpacking)
and `rollout` (Sample records). Prints a table and, last, `RESULT engine_overhead_ratio=<x>`
(median over rounds of rollflow tokens/s divided by raw tokens/s; 1.0 = no overhead).

    bin/dev python bench/engine_overhead.py [--requests 32] [--tokens 128] [--rounds 6] [--model tiny]
"""

from __future__ import annotations

import argparse
import asyncio

from sidebyside import alternate, engine_args, report, workload

from rollflow.config import EngineConfig
from rollflow.engine.environment import sampling_params
from rollflow.engine.vllm import VLLMEngine
from rollflow.models import resolve_model
from rollflow.records import Prompt, SamplingSpec
from rollflow.rollout import rollout


async def raw_round(engine: VLLMEngine, prompts: list[list[int]], spec: SamplingSpec, tag: str) -> int:
    params = sampling_params(spec)

    async def one(i: int, ids: list[int]) -> int:
        tokens, logprobs = [], []
        async for out in engine.llm.generate({"prompt_token_ids": ids}, params, f"raw-{tag}-{i}"):
            completion = out.outputs[0]
            tokens += completion.token_ids
            logprobs += completion.logprobs or []
        return len(tokens)

    return sum(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))


async def rollflow_round(engine: VLLMEngine, prompts: list[list[int]], spec: SamplingSpec, tag: str) -> int:
    samples = await asyncio.gather(
        *(
            rollout(engine, Prompt(id=f"p{i}", token_ids=p), spec, group_id=f"rf-{tag}-{i}", index=0)
            for i, p in enumerate(prompts)
        )
    )
    return sum(s.num_tokens for s in samples)


async def main(args: argparse.Namespace) -> None:
    engine = VLLMEngine(resolve_model(args.model), EngineConfig(max_num_seqs=max(args.requests, 16)))
    await engine.start()
    try:
        prompts, spec = workload(args)
        await raw_round(engine, prompts[:4], spec, "warmup")  # one-off logprobs compile
        totals, pair_ratios = await alternate(
            [
                ("raw AsyncLLM", lambda tag: raw_round(engine, prompts, spec, tag)),
                ("rollflow engine+rollout", lambda tag: rollflow_round(engine, prompts, spec, tag)),
            ],
            args.rounds,
        )
    finally:
        await engine.aclose()
    report(totals, pair_ratios, args, "engine_overhead_ratio")


if __name__ == "__main__":
    asyncio.run(main(engine_args(__doc__)))
