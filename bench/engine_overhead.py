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
import statistics
import time

from rollflow.config import EngineConfig
from rollflow.engine.vllm import VLLMEngine, _sampling_params
from rollflow.models import resolve_model
from rollflow.records import Prompt, SamplingSpec
from rollflow.rollout import rollout


async def raw_round(engine: VLLMEngine, prompts: list[list[int]], spec: SamplingSpec, tag: str) -> int:
    params = _sampling_params(spec)

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
        prompts = [[1, 100 + i, 202, 276, 261, 264, 277] for i in range(args.requests)]
        spec = SamplingSpec(temperature=1.0, max_tokens=args.tokens, ignore_eos=True, seed=None)
        await raw_round(engine, prompts[:4], spec, "warmup")  # one-off logprobs compile
        totals = {"raw AsyncLLM": [0, 0.0], "rollflow engine+rollout": [0, 0.0]}
        pair_ratios = []
        paths = [("raw AsyncLLM", raw_round), ("rollflow engine+rollout", rollflow_round)]
        rate: dict[str, float] = {}
        for r in range(args.rounds):
            # Alternate which path goes first so neither always runs on a warmer engine.
            for name, fn in paths if r % 2 == 0 else paths[::-1]:
                began = time.perf_counter()
                tokens = await fn(engine, prompts, spec, f"{r}")
                seconds = time.perf_counter() - began
                totals[name][0] += tokens
                totals[name][1] += seconds
                rate[name] = tokens / seconds
            pair_ratios.append(rate["rollflow engine+rollout"] / rate["raw AsyncLLM"])
    finally:
        await engine.aclose()
    print(f"{'path':<26}{'tokens':>10}{'seconds':>10}{'tokens/s':>12}")
    rates = {}
    for name, (tokens, seconds) in totals.items():
        rates[name] = tokens / seconds
        print(f"{name:<26}{tokens:>10}{seconds:>10.2f}{rates[name]:>12.0f}")
    # The median of per-round ratios resists the machine's noise better than the ratio of totals.
    ratio = statistics.median(pair_ratios)
    print("per-round ratios: " + " ".join(f"{r:.3f}" for r in pair_ratios))
    print(f"requests={args.requests} tokens/request={args.tokens} rounds={args.rounds} model={args.model}")
    print(f"RESULT engine_overhead_ratio={ratio:.3f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--model", default="tiny")
    asyncio.run(main(parser.parse_args()))
