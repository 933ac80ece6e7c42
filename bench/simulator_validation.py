"""Simulator validation: calibrate on measured CPU runs, predict another configuration, run it.

1. Measure the real vLLM engine (tiny model) decoding batches of 4, 16 and 32 requests, and
   fit the simulated engine's step time (fixed + per sequence) and prefill cost; measure how
   much decoding and a training step slow each other down when both run (2 cores: the
   controller's loop, which processes the engine's output, shares a core with the trainer).
2. Run configuration A for real (synchronous, 8 groups of 4 per step) and take from it the
   trainer's time per token, the weight-sync times and the completion lengths (trace.json).
3. Simulate A and configuration B (max_lag 2, 4 groups per step) with those profiles, run B for
   real, and print predicted vs measured steps/s and trainer idle for both.

Engine on core 0, controller and trainer on core 1, as in bench/overlap.py (whose `tiny` workload
this reuses: tiny model, ≤ 64 tokens, a 400-character system prompt). Last line:
`RESULT sim_error_pct=<x>`, the steps/s error on B.

    bin/dev python bench/simulator_validation.py [--steps 24]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import machine
from overlap import CONTROLLER_CORE, ENGINE_CORE, SYSTEM_WORDS, pin

from rollflow.config import Config, load_config
from rollflow.controller import train
from rollflow.engine.vllm import VLLMEngine
from rollflow.models import load_tokenizer, prompt_encoder, resolve_model
from rollflow.records import SamplingSpec
from rollflow.sampler import Sampler
from rollflow.sim import Scenario, simulate
from rollflow.sim.components import EngineProfile, LengthModel, TrainerProfile

BATCHES = (4, 16, 32)
SHORT, LONG = 8, 48


def config_for(max_lag: int, groups: int, steps: int) -> Config:
    return load_config(
        preset="tiny",
        overrides=[
            f"run.max_lag={max_lag}",
            f"run.max_steps={steps}",
            f"run.groups_per_step={groups}",
            "sampling.max_tokens=64",
            "trainer.micro_batch_tokens=8192",
            f"data.system_prompt='{SYSTEM_WORDS[:400]}'",
            "observe.sinks=[]",
        ],
    )


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares y = a + b·x; returns (a, b)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


async def measure_engine(config: Config) -> tuple[EngineProfile, int, float]:
    """Decode step time per batch size, from (time of LONG tokens − time of SHORT) / (LONG − SHORT)."""
    path = resolve_model(config.model.path)
    sampler = Sampler(config.data, prompt_encoder(load_tokenizer(path), config.data))
    prompts = [sampler.next() for _ in range(max(BATCHES))]
    prompt_len = round(sum(len(p.token_ids) for p in prompts) / len(prompts))
    pin(ENGINE_CORE)
    engine = VLLMEngine(path, config.engine)
    await engine.start()
    pin(CONTROLLER_CORE)
    steps, prefills = [], []
    try:

        async def generate(batch: int, tokens: int, tag: str) -> float:
            spec = SamplingSpec(max_tokens=tokens, ignore_eos=True)

            async def one(i: int) -> None:
                async for _ in engine.stream(f"{tag}-{i}", prompts[i].token_ids, spec, deltas=False):
                    pass

            began = time.monotonic()
            await asyncio.gather(*(one(i) for i in range(batch)))
            return time.monotonic() - began

        await generate(4, 8, "warm")
        for batch in BATCHES:
            short = min([await generate(batch, SHORT, f"s{batch}.{r}") for r in range(3)])
            long = min([await generate(batch, LONG, f"l{batch}.{r}") for r in range(3)])
            step = (long - short) / (LONG - SHORT)
            steps.append(step)
            prefills.append(max(short - SHORT * step, 0.0) / (batch * prompt_len))
            print(f"engine: batch {batch:>2}: {step * 1e3:.2f} ms per step, {1 / step * batch:.0f} tokens/s")
        engine_factor, trainer_factor = await measure_contention(engine, config, path, prompts, generate)
    finally:
        await engine.aclose()
    fixed, per_seq = fit_line([float(b) for b in BATCHES], steps)
    profile = EngineProfile(
        fixed_s=max(fixed, 0.0),
        per_seq_s=max(per_seq, 0.0),
        prefill_per_token_s=sum(prefills) / len(prefills),
        max_num_seqs=config.engine.max_num_seqs,
        contended=engine_factor,
    )
    return profile, prompt_len, trainer_factor


async def measure_contention(engine, config, path, prompts, generate) -> tuple[float, float]:
    """How much a training step and decoding slow each other down on this host: decode steps of
    32 requests with and without a trainer stepping in a thread, trainer steps with and without
    the engine decoding."""
    import threading

    import torch

    from rollflow.batch import train_sample
    from rollflow.records import TrainBatch
    from rollflow.rollout import rollout
    from rollflow.trainer import Trainer

    torch.set_num_threads(1)
    spec = SamplingSpec(max_tokens=64)
    samples = await asyncio.gather(
        *(rollout(engine, prompts[i], spec, group_id=f"c{i}", index=0) for i in range(32))
    )
    batch = TrainBatch(step=0, samples=[train_sample(s, 1.0) for s in samples], max_tokens=64)
    trainer = await asyncio.to_thread(Trainer, path, config.trainer, config.loss)

    def timed_step() -> float:
        began = time.monotonic()
        trainer.step(batch)
        return time.monotonic() - began

    alone = min([await asyncio.to_thread(timed_step) for _ in range(3)])

    async def decode_step(tag: str) -> float:
        short = min([await generate(32, SHORT, f"{tag}s{r}") for r in range(3)])
        long = min([await generate(32, LONG, f"{tag}l{r}") for r in range(3)])
        return (long - short) / (LONG - SHORT)

    free = await decode_step("free")
    stop = threading.Event()

    def train_loop() -> None:
        while not stop.is_set():
            trainer.step(batch)

    worker = asyncio.create_task(asyncio.to_thread(train_loop))
    try:
        busy = await decode_step("busy")
    finally:
        stop.set()
        await worker
    generating = True

    async def decode_loop() -> None:
        rounds = 0
        while generating:
            await generate(32, LONG, f"bg{rounds}")
            rounds += 1

    background = asyncio.create_task(decode_loop())
    try:
        await asyncio.sleep(0.2)
        contended = sum([await asyncio.to_thread(timed_step) for _ in range(3)]) / 3
    finally:
        generating = False
        await background
    print(f"contention: decode step {free * 1e3:.2f} -> {busy * 1e3:.2f} ms while training; "
          f"train step {alone:.3f} -> {contended:.3f} s while decoding")
    return busy / free, contended / alone


async def run_real(config: Config, out: Path) -> dict[str, float]:
    pin(ENGINE_CORE)
    result = await train(config, out, on_step=lambda _row: pin(CONTROLLER_CORE))
    return summary(result.metrics)


def summary(metrics: list[dict]) -> dict[str, float]:
    steady = metrics[1:]
    wall = metrics[-1]["wall_s"] - metrics[0]["wall_s"]
    return {
        "steps_per_s": len(steady) / wall,
        "trainer_idle": sum(m["batch_wait_s"] + m["weight_sync_s"] for m in steady) / wall,
        "train_step_s": sum(m["train_step_s"] for m in steady) / len(steady),
        "gen_tokens_per_s": sum(m["gen_tokens_per_s"] for m in steady) / len(steady),
    }


def calibrate_trainer(out: Path, prompt_len: int) -> TrainerProfile:
    """Trainer time per token and weight-sync times from a real run's metrics."""
    import json

    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][1:]
    tokens = [m["samples"] * prompt_len + m["tokens"] for m in metrics]
    fixed, per_token = fit_line([float(t) for t in tokens], [m["train_step_s"] for m in metrics])
    if per_token <= 0:  # too little spread in batch sizes: put it all in the per-token cost
        fixed, per_token = 0.0, sum(m["train_step_s"] for m in metrics) / sum(tokens)
    weight_bytes = int(metrics[0]["weight_sync_bytes"])
    stage_s = sum(m["weight_sync_s"] for m in metrics) / len(metrics)
    load_s = sum(m["engine_update_s"] for m in metrics) / len(metrics)
    return TrainerProfile(
        s_per_token=per_token,
        fixed_s=max(fixed, 0.0),
        weight_bytes=weight_bytes,
        stage_bytes_per_s=weight_bytes / max(stage_s, 1e-6),
        sync_bytes_per_s=weight_bytes / max(load_s, 1e-6),
        snapshots=True,
    )


def predict(engine: EngineProfile, trainer: TrainerProfile, lengths: LengthModel, prompt_len: int,
            max_lag: int, groups: int, steps: int) -> dict[str, float]:
    result = simulate(Scenario(
        engine=engine, trainer=trainer, lengths=lengths, max_lag=max_lag, steps=steps, groups_per_step=groups,
        group_size=4, prompt_tokens=prompt_len, max_tokens=64,
    ))
    return summary(result.metrics)


async def measure(args: argparse.Namespace) -> dict:
    """Everything real: the engine microbenchmark and runs A and B."""
    a, b = config_for(0, 8, args.steps), config_for(2, 4, args.steps)
    engine, prompt_len, trainer_factor = await measure_engine(a)
    print(f"engine profile: fixed {engine.fixed_s * 1e3:.2f} ms + {engine.per_seq_s * 1e3:.3f} ms/seq per step, "
          f"prefill {engine.prefill_per_token_s * 1e6:.1f} us/token, x{engine.contended:.2f} while training; "
          f"prompts {prompt_len} tokens")
    with tempfile.TemporaryDirectory() as scratch:
        out_a, out_b = Path(scratch) / "a", Path(scratch) / "b"
        measured_a = await run_real(a, out_a)
        trainer = replace(calibrate_trainer(out_a, prompt_len), contended=trainer_factor)
        lengths = LengthModel.parse(str(out_a / "trace.json"), rho=0.5)
        print(f"trainer profile: {trainer.fixed_s * 1e3:.1f} ms + {trainer.s_per_token * 1e6:.2f} us/token; "
              f"x{trainer.contended:.2f} while decoding; weights {trainer.weight_bytes / 1e6:.1f} MB")
        measured_b = await run_real(b, out_b)
    return {"engine": engine, "trainer": trainer, "lengths": lengths, "prompt_len": prompt_len,
            "a": measured_a, "b": measured_b}


def main(args: argparse.Namespace) -> None:
    m = asyncio.run(measure(args))
    profiles = (m["engine"], m["trainer"], m["lengths"], m["prompt_len"])
    rows = {
        "A: max_lag 0, 8 groups (calibration)": (predict(*profiles, 0, 8, args.steps), m["a"]),
        "B: max_lag 2, 4 groups": (predict(*profiles, 2, 4, args.steps), m["b"]),
    }
    print(f"{'configuration':<38}{'steps/s sim':>12}{'real':>8}{'error':>8}{'trainer idle sim':>18}{'real':>8}"
          f"{'step s sim':>12}{'real':>8}{'gen tok/s sim':>15}{'real':>8}")
    for name, (sim, real) in rows.items():
        error = 100 * (sim["steps_per_s"] - real["steps_per_s"]) / real["steps_per_s"]
        print(f"{name:<38}{sim['steps_per_s']:>12.2f}{real['steps_per_s']:>8.2f}{error:>+7.1f}%"
              f"{sim['trainer_idle']:>18.1%}{real['trainer_idle']:>8.1%}{sim['train_step_s']:>12.3f}"
              f"{real['train_step_s']:>8.3f}{sim['gen_tokens_per_s']:>15.0f}{real['gen_tokens_per_s']:>8.0f}")
    sim_b, real_b = rows["B: max_lag 2, 4 groups"]
    error_b = abs(100 * (sim_b["steps_per_s"] - real_b["steps_per_s"]) / real_b["steps_per_s"])
    print(machine.describe())
    print(f"RESULT sim_error_pct={error_b:.1f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=24)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", str(ENGINE_CORE))
    main(args)
