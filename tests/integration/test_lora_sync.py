"""Adapter-only sync into a LoRA-enabled vLLM engine, against HF + peft."""

from __future__ import annotations

import asyncio

import pytest
import torch

from rollflow.config import EngineConfig, LoRAConfig, TrainerConfig
from rollflow.engine import EngineOutput
from rollflow.engine.vllm import VLLMEngine
from rollflow.models import tiny_model_path
from rollflow.records import Prompt, SamplingSpec
from rollflow.rollout import rollout
from rollflow.trainer import Trainer

pytestmark = pytest.mark.integration

PROMPT = [1, 735, 202, 276, 261, 264, 277, 281, 34, 2, 202, 1, 871, 202]


@pytest.fixture(scope="module")
async def lora_engine():
    engine = VLLMEngine(
        tiny_model_path(0),
        EngineConfig(kv_cache_bytes=64 * 1024 * 1024, max_model_len=256, max_num_seqs=8, max_loras=3,
                     max_lora_rank=8),
    )
    await engine.start()
    yield engine
    await engine.aclose()


@torch.no_grad()
def peft_greedy(trainer: Trainer, prompt: list[int], n: int) -> list[int]:
    trainer.lm.eval()
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(trainer.lm(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def trained_adapter(trainer: Trainer, make_batch, seed: int) -> None:
    batch = make_batch(trainer, seed=seed)
    for _ in range(3):
        trainer.step(batch)


async def test_adapter_sync_matches_peft_and_in_flight_requests_finish_on_their_adapter(lora_engine, make_batch):
    engine = lora_engine
    trainer = Trainer(tiny_model_path(0), TrainerConfig(lr=5e-2, lora=LoRAConfig(enabled=True, rank=8)))
    base = peft_greedy(trainer, PROMPT, 16)  # B = 0: the adapter starts as the base model
    trained_adapter(trainer, make_batch, seed=0)
    v1 = await engine.update_adapter(trainer.adapter_weights(), trainer.adapter_config())
    want_v1 = peft_greedy(trainer, PROMPT, 48)
    assert want_v1[:16] != base, "training must have changed the adapter's output"
    spec = SamplingSpec(temperature=0.0, max_tokens=16, ignore_eos=True)
    out = await engine.generate(PROMPT, spec, "lora-v1")
    assert out.token_ids == want_v1[:16]
    assert out.versions == [v1] * 16

    # A long request on adapter v1 is in flight when v2 arrives: it finishes on v1.
    long = SamplingSpec(temperature=0.0, max_tokens=48, ignore_eos=True)
    task = asyncio.create_task(rollout(engine, Prompt(id="lf", token_ids=PROMPT), long, group_id="lf", index=0))
    while engine.num_live == 0:
        await asyncio.sleep(0.005)
    trained_adapter(trainer, make_batch, seed=1)
    v2 = await engine.update_adapter(trainer.adapter_weights(), trainer.adapter_config())
    assert engine.loaded_adapters == [v1, v2]  # v1 stays loaded while in use
    # What a checkpoint (or a rescue from a dead engine) saves of it carries v1 too, not the base
    # model's label: adapters are versioned by name, vLLM's weight label never changes.
    while not (engine.partial("lf/0") or EngineOutput([], [])).token_ids:
        await asyncio.sleep(0.005)
    saved = engine.partial("lf/0")
    assert saved is not None and 0 < len(saved.versions) == len(saved.token_ids)
    assert saved.versions == [v1] * len(saved.token_ids)
    sample = await task
    assert sample.finish_reason == "length" and sample.completion_token_ids == want_v1
    assert sample.versions == [v1] * 48
    want_v2 = peft_greedy(trainer, PROMPT, 16)
    assert want_v2 != want_v1[:16]
    assert (await engine.generate(PROMPT, spec, "lora-v2")).token_ids == want_v2
    await engine.collect_adapters()
    assert engine.loaded_adapters == [v2]  # unused adapters are unloaded
