"""Adapter-only sync into a LoRA-enabled vLLM engine, against HF + peft."""

from __future__ import annotations

import msgspec
import pytest
import torch

from rollflow.config import EngineConfig, LoRAConfig, TrainerConfig
from rollflow.engine.vllm import VLLMEngine
from rollflow.models import tiny_model_path
from rollflow.records import SamplingSpec
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


async def test_adapter_sync_matches_peft_and_in_flight_requests_finish_on_their_adapter(
    lora_engine, make_batch, streaming
):
    engine = lora_engine
    trainer = Trainer(tiny_model_path(0), TrainerConfig(lr=5e-2, lora=LoRAConfig(enabled=True, rank=8)))
    base = peft_greedy(trainer, PROMPT, 16)  # B = 0: the adapter starts as the base model
    trained_adapter(trainer, make_batch, seed=0)
    v1 = await engine.update_adapter(trainer.adapter_weights(), trainer.adapter_config())
    want_v1 = peft_greedy(trainer, PROMPT, 160)
    assert want_v1[:16] != base, "training must have changed the adapter's output"
    spec = SamplingSpec(temperature=0.0, max_tokens=16, ignore_eos=True)
    out = await engine.generate(PROMPT, spec, "lora-v1")
    assert out.token_ids == want_v1[:16]
    assert out.versions == [v1] * 16
    # Version 0 is the base model: an episode begun before the first adapter can keep it.
    on_base = await engine.generate(PROMPT, msgspec.structs.replace(spec, on_version=0), "lora-on-base")
    assert on_base.token_ids == base and on_base.versions == [0] * 16

    # A long request on adapter v1 is in flight when v2 arrives: it finishes on v1. (v2 is trained
    # first, so the update lands while the request streams however fast the machine generates.)
    trained_adapter(trainer, make_batch, seed=1)
    task = await streaming(engine, PROMPT, "lf", 160, after_tokens=1)
    v2 = await engine.update_adapter(trainer.adapter_weights(), trainer.adapter_config())
    assert engine.loaded_adapters == [v1, v2]  # v1 stays loaded while in use
    # What a checkpoint (or a rescue from a dead engine) saves of it carries v1 too, not the base
    # model's label: adapters are versioned by name, vLLM's weight label never changes.
    saved = engine.partial("lf/0")
    assert saved is not None and 0 < len(saved.versions) == len(saved.token_ids)
    assert saved.versions == [v1] * len(saved.token_ids)
    sample = await task
    assert sample.finish_reason == "length" and sample.completion_token_ids == want_v1
    assert sample.versions == [v1] * 160
    want_v2 = peft_greedy(trainer, PROMPT, 16)
    assert want_v2 != want_v1[:16]
    assert (await engine.generate(PROMPT, spec, "lora-v2")).token_ids == want_v2
    # The newest max_loras - 1 (here 2) stay loaded, so an episode's later turn can still ask
    # for the adapter its first turn used; once it falls out of them and no request uses it, it goes.
    await engine.collect_adapters()
    assert engine.loaded_adapters == [v1, v2]
    on_v1 = msgspec.structs.replace(spec, on_version=v1)
    asked = await engine.generate(PROMPT, on_v1, "lora-on-v1")
    assert asked.token_ids == want_v1[:16] and asked.versions == [v1] * 16
    trained_adapter(trainer, make_batch, seed=2)
    v3 = await engine.update_adapter(trainer.adapter_weights(), trainer.adapter_config())
    assert engine.loaded_adapters == [v2, v3]  # unused adapters are unloaded
    fallen = await engine.generate(PROMPT, on_v1, "lora-v1-gone")
    assert fallen.versions == [v3] * 16 and fallen.token_ids == peft_greedy(trainer, PROMPT, 16)


async def test_a_lora_runs_checkpoint_saves_each_in_flight_token_with_its_adapter_version(tmp_path):
    """Checkpoints taken while samples are mid-generation in a LoRA run: the saved tokens carry
    the adapter version that generated them (vLLM's own weight label stays 0 in a LoRA run)."""
    from rollflow.checkpoint import read_state
    from rollflow.config import load_config
    from rollflow.controller import train

    config = load_config(preset="tiny", overrides=[
        "trainer.lora.enabled=true", "run.max_lag=1", "run.max_steps=4", "run.groups_per_step=2",
        "sampling.max_tokens=96", "sampling.ignore_eos=true", "checkpoint.every=1", "checkpoint.keep_last=10",
    ])
    await train(config, tmp_path)
    saved = []  # (steps done at the checkpoint, versions of a partial sample's tokens)
    for folder in sorted((tmp_path / "checkpoints").glob("step-*")):
        state = read_state(folder)
        if state.step < 2:
            continue  # after step 1, samples may still run on the base model (version 0)
        partial = [s for g in state.in_flight for s in g.samples if s.done is None and s.tokens]
        saved += [(state.step, s.versions) for s in partial]
    assert saved, "no checkpoint after step 2 caught a sample mid-generation"
    for steps, versions in saved:
        # In flight after `steps` steps, a sample is used at step >= steps, so with max_lag 1 it
        # started on adapter version >= steps - 1, and keeps that adapter to its end.
        assert len(set(versions)) == 1 and versions[0] >= steps - 1, (steps, versions)


@pytest.mark.timeout(600)
async def test_an_episode_keeps_the_adapter_its_first_turn_used(tmp_path):
    """A LoRA run with `max_lag = 2` whose agent makes three calls per episode, waiting between
    them while updates land: every later turn asks for the adapter version of the episode's
    first turn, and the engine still holds it (the newest `max_loras - 1` are kept), so no sample
    mixes versions, though updates landed while episodes were in flight."""
    import asyncio

    import openai

    import rollflow

    async def agent(task, base_url):
        async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
            messages = list(task.messages)
            for _ in range(3):
                reply = await client.chat.completions.create(model=task.model, messages=messages, max_tokens=6)
                messages += [reply.choices[0].message.model_dump(exclude_none=True),
                             {"role": "user", "content": "Go on."}]
                await asyncio.sleep(0.3)  # an update may land before the next call
        return float(len(messages))

    config = rollflow.load_config(preset="tiny", overrides=[
        "trainer.lora.enabled=true", "run.max_lag=2", "run.max_steps=6", "run.groups_per_step=2",
        "env.kind=agent", "env.max_tokens=96", "observe.sinks=[]",
    ])
    result = await rollflow.Controller(config, tmp_path, agent=agent).run()
    assert result.steps == 6 and rollflow.audit_ledger(tmp_path).ok
    assert all(m["turns_mean"] == 3.0 for m in result.metrics)
    assert [m["mixed_version_samples"] for m in result.metrics] == [0] * 6
    moved = sum(n for m in result.metrics for lag, n in m["lag_in_flight_hist"].items() if int(lag) > 0)
    assert moved > 0, "no update landed while an episode was in flight: the test shows nothing"
