"""Sample a few completions from the tiny model with rollflow's engine and rollout.

    bin/dev python examples/generate.py

Prints each completion with its per-token behaviour log-probs and versions.
"""

from __future__ import annotations

import asyncio

from rollflow import Sampler, SamplingSpec, load_config, resolve_model, rollout
from rollflow.engine.vllm import VLLMEngine
from rollflow.models import load_tokenizer, prompt_encoder


async def main() -> None:
    config = load_config(preset="tiny")
    path = resolve_model(config.model.path)
    tokenizer = load_tokenizer(path)
    sampler = Sampler(config.data, prompt_encoder(tokenizer, config.data))
    spec = SamplingSpec(temperature=1.0, max_tokens=12)
    async with VLLMEngine(path, config.engine) as engine:
        prompt = sampler.next()
        samples = await asyncio.gather(
            *(rollout(engine, prompt, spec, group_id=prompt.id, index=i) for i in range(4))
        )
    print(prompt.messages[-1].content)
    for sample in samples:
        text = tokenizer.decode(sample.completion_token_ids, skip_special_tokens=True)
        logprobs = ", ".join(f"{lp:.2f}" for lp in sample.logprobs[:4])
        print(f"  {text!r}  finish={sample.finish_reason} logprobs[:4]=[{logprobs}] versions={set(sample.versions)}")


if __name__ == "__main__":  # vLLM spawns processes: keep the guard
    asyncio.run(main())
