"""Simulator validation: calibrate on measured CPU runs, predict another configuration, run it.

1. Measure the real vLLM engine (tiny model) decoding batches of 1 to 32 requests: the
   simulated engine's step time is that table, interpolated (a CPU's step is not linear in the
   batch), plus the prefill cost; measure how much decoding and a training step slow each other
   down when both run (2 cores: the controller's loop, which processes the engine's output,
   shares a core with the trainer).
2. Run configuration A for real (synchronous, 8 groups of 4 per step) and fit to its metrics the
   trainer's time per model token (the tokens its layout puts through the model:
   `rollflow.sim.calibrate.trainer_profile`), the weight-sync times and the completion lengths.
3. Simulate A (the replay of the calibration run) and configuration B (max_lag 2, 4 groups per
   step) with those profiles, run B for real, and print simulated vs measured steps/s, trainer
   idle and the samples' mean lag in flight, in the queue and in all, beside the closed form of
   rollflow's admission rule (`rollflow.sim.calibrate.admission_lag`: min(step, max_lag)).
   `--save-profile FILE` keeps the calibration with both errors, for
   `python -m rollflow simulate --profile FILE`.

Engine on core 0, controller and trainer on core 1, as in bench/overlap.py (whose `tiny` workload
this reuses: tiny model, ≤ 64 tokens, a 400-character system prompt). Last line:
`RESULT sim_error_pct=<x> replay_error_pct=<y> replay_idle_pts=<z> predicted_idle_pts=<w>`:
the steps/s error on B, on A, and the trainer-idle errors in percentage points.

    bin/dev python bench/simulator_validation.py [--steps 24] [--save-profile FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import machine
import msgspec
from overlap import CONTROLLER_CORE, ENGINE_CORE, SYSTEM_WORDS, pin

from rollflow.config import Config, load_config
from rollflow.controller import train
from rollflow.engine.vllm import VLLMEngine
from rollflow.models import load_tokenizer, prompt_encoder, resolve_model
from rollflow.records import SamplingSpec
from rollflow.rollout import rollout
from rollflow.sampler import Sampler
from rollflow.sim import Scenario, simulate
from rollflow.sim.calibrate import (
    Calibration,
    admission_lag,
    engine_profile,
    errors,
    fit_line,
    fit_to_run,
    summary,
    trainer_profile,
)
from rollflow.sim.components import EngineProfile, TrainerProfile
from rollflow.sim.lengths import LengthModel
from rollflow.trainer.batches import model_tokens

BATCHES = (1, 2, 4, 8, 16, 24, 32)
LONG = 64
REPEATS = 3
"""Each timing is the fastest of this many (the machine's noise only ever adds time)."""
CONTENDED_BATCH = 32
"""The engine batch decoding beside the trainer when contention is measured."""
PREFILL_BATCHES = (1, 8, 16, 32)
"""Numbers of fresh prompts prefilled at once, for the prefill's cost per token."""
VOCAB_TOP = 800
"""Fresh prompts draw token ids below this (the tiny model's vocabulary has 872)."""
STEPS = 5
"""Trainer steps timed alone and beside the engine, each side's median taken."""


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


async def measure_engine(config: Config) -> tuple[EngineProfile, int, float, tuple[float, float]]:
    """Decode step time per batch size (`step_times`), the prefill per prompt token, the trainer's
    step and how engine and trainer slow each other down (`measure_contention`)."""
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

        def seeded(spec: SamplingSpec, i: int) -> SamplingSpec:
            # Every request of a run carries its own seed, which vLLM samples request by request.
            return msgspec.structs.replace(spec, seed=i)

        async def generate(batch: int, tokens: int, tag: str) -> float:
            # Through `rollout`, as the controller generates: its per-token work on the loop counts.
            spec = SamplingSpec(max_tokens=tokens, ignore_eos=True)
            began = time.monotonic()
            await asyncio.gather(
                *(rollout(engine, prompts[i], seeded(spec, i), group_id=f"{tag}-{i}", index=0) for i in range(batch))
            )
            return time.monotonic() - began

        async def step_times(batch: int, tag: str) -> tuple[float, float]:
            """(the median gap between a request's successive tokens, the median time to its first
            token) with `batch` requests decoding together: each gap is one engine step as the
            caller sees it, and the median shrugs off the machine's hiccups."""
            spec = SamplingSpec(max_tokens=LONG, ignore_eos=True)
            gaps: list[float] = []
            firsts: list[float] = []

            async def one(i: int) -> None:
                began = last = time.monotonic()
                async for out in engine.stream(f"{tag}-{i}", prompts[i].token_ids, seeded(spec, i)):
                    now = time.monotonic()
                    if last == began:
                        firsts.append(now - began)
                    else:
                        gaps.extend([(now - last) / len(out.token_ids)] * len(out.token_ids))
                    last = now

            await asyncio.gather(*(one(i) for i in range(batch)))
            return statistics.median(gaps), statistics.median(firsts)

        fresh = random.Random(0)

        async def prefill_time(batch: int, tag: str) -> float:
            """Seconds until `batch` prompts never seen before (no prefix-cache hit: after a weight
            update the cache is empty) have each produced their first token."""
            spec = SamplingSpec(max_tokens=1, ignore_eos=True)
            new = [[1] + [fresh.randrange(3, VOCAB_TOP) for _ in range(prompt_len - 1)] for _ in range(batch)]
            began = time.monotonic()
            await asyncio.gather(*(engine.generate(p, seeded(spec, i), f"{tag}-{i}") for i, p in enumerate(new)))
            return time.monotonic() - began

        await generate(4, 8, "warm")
        for batch in BATCHES:
            step, _ = min([await step_times(batch, f"b{batch}.{r}") for r in range(REPEATS)])
            steps.append(step)
            print(f"engine: batch {batch:>2}: {step * 1e3:.2f} ms per step, {1 / step * batch:.0f} tokens/s")
        # A step's prefill costs this much more per prompt token (the slope over batch sizes; the
        # fixed part is the decode step's).
        sizes = PREFILL_BATCHES
        times = [min([await prefill_time(b, f"pf{b}.{r}") for r in range(REPEATS)]) for b in sizes]
        prefills.append(max(fit_line([float(b * prompt_len) for b in sizes], times)[1], 0.0))
        engine_factor, trainer_factor, trainer_fit = await measure_contention(
            engine, config, path, prompts, generate, step_times
        )
    finally:
        await engine.aclose()
    profile = engine_profile(
        dict(zip(BATCHES, steps, strict=True)),
        prefill_per_token_s=prefills[0],
        max_num_seqs=config.engine.max_num_seqs,
        contended=engine_factor,
    )
    return profile, prompt_len, trainer_factor, trainer_fit


async def measure_contention(
    engine, config, path, prompts, generate, step_times
) -> tuple[float, float, tuple[float, float]]:
    """The trainer's step time alone for 2 and 8 groups of 4 (a fixed part and a part per model
    token, through the two), and how much a training step and decoding slow each other down on
    this host: decode steps of 32 requests with and without a trainer stepping in a thread,
    trainer steps with and without the engine decoding."""
    import threading

    import torch

    from rollflow.batch import train_sample
    from rollflow.records import TrainBatch
    from rollflow.trainer import Trainer

    torch.set_num_threads(1)
    spec = SamplingSpec(max_tokens=64)
    samples = await asyncio.gather(  # 8 groups of 4, as configuration A's steps
        *(rollout(engine, prompts[i // 4], spec, group_id=f"c{i // 4}", index=i % 4) for i in range(32))
    )
    trained = [train_sample(s, 1.0) for s in samples]
    batch = TrainBatch(step=0, samples=trained, max_tokens=64)
    small = TrainBatch(step=0, samples=trained[:8], max_tokens=64)  # 2 groups
    trainer = await asyncio.to_thread(Trainer, path, config.trainer, config.loss)

    def timed_step(which: TrainBatch = batch) -> float:
        began = time.monotonic()
        trainer.step(which)
        return time.monotonic() - began

    for _ in range(2):  # the first steps allocate and warm the kernels up: not what a run's steps cost
        await asyncio.to_thread(timed_step)
    # Medians of as many steps alone as beside the engine: the machine's noise only adds time, so
    # a fastest-of alone against a mean beside it would count noise as contention.
    before = [await asyncio.to_thread(timed_step) for _ in range(STEPS)]
    alone = statistics.median(before)
    alone_small = statistics.median([await asyncio.to_thread(timed_step, small) for _ in range(STEPS)])
    budget, layout = config.trainer.micro_batch_tokens, config.trainer.layout
    tokens = [model_tokens(b.samples, budget, layout) for b in (small, batch)]
    fixed, per_token = fit_line([float(t) for t in tokens], [alone_small, alone])
    print(f"trainer: {alone_small:.3f} s for {tokens[0]} model tokens, {alone:.3f} s for {tokens[1]} "
          f"-> {fixed * 1e3:.1f} ms + {per_token * 1e6:.2f} us per model token")

    async def decode_step(tag: str) -> float:
        return min([(await step_times(32, f"{tag}{r}"))[0] for r in range(REPEATS)])

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
            await generate(CONTENDED_BATCH, LONG, f"bg{rounds}")
            rounds += 1

    background = asyncio.create_task(decode_loop())
    try:
        await asyncio.sleep(0.2)
        contended = statistics.median([await asyncio.to_thread(timed_step) for _ in range(STEPS)])
    finally:
        generating = False
        await background
    # Steps alone again, after those beside the engine: the machine's speed drifts within
    # minutes, and alone steps on both sides of them keep the drift out of the ratio.
    after = [await asyncio.to_thread(timed_step) for _ in range(STEPS)]
    alone = statistics.median([*before, *after])
    print(f"contention: decode step {free * 1e3:.2f} -> {busy * 1e3:.2f} ms while training; "
          f"train step {alone:.3f} -> {contended:.3f} s while decoding")
    return busy / free, contended / alone, (max(fixed, 0.0), per_token)


async def run_real(config: Config, out: Path) -> tuple[dict[str, float], list[dict]]:
    pin(ENGINE_CORE)
    result = await train(config, out, on_step=lambda _row: pin(CONTROLLER_CORE))
    return summary(result.metrics), result.metrics


def simulated(engine: EngineProfile, trainer: TrainerProfile, lengths: LengthModel, prompt_len: int,
              max_lag: int, groups: int, steps: int) -> list[dict]:
    result = simulate(Scenario(
        engine=engine, trainer=trainer, lengths=lengths, max_lag=max_lag, steps=steps, groups_per_step=groups,
        group_size=4, prompt_tokens=prompt_len, max_tokens=64,
    ))
    return result.metrics


def predict(*profiles, max_lag: int, groups: int, steps: int) -> dict[str, float]:
    return summary(simulated(*profiles, max_lag, groups, steps))


async def measure(args: argparse.Namespace) -> dict:
    """Everything real: the engine microbenchmark and runs A and B."""
    a, b = config_for(0, 8, args.steps), config_for(2, 4, args.steps)
    engine, prompt_len, trainer_factor, trainer_fit = await measure_engine(a)
    print(f"engine profile: fixed {engine.fixed_s * 1e3:.2f} ms + {engine.per_seq_s * 1e3:.3f} ms/seq per step, "
          f"prefill {engine.prefill_per_token_s * 1e6:.1f} us/token, x{engine.contended:.2f} while training; "
          f"prompts {prompt_len} tokens")
    with tempfile.TemporaryDirectory() as scratch:
        out_a, out_b = Path(scratch) / "a", Path(scratch) / "b"
        measured_a, metrics_a = await run_real(a, out_a)
        trainer = trainer_profile(
            metrics_a, layout=a.trainer.layout, micro_batch_tokens=a.trainer.micro_batch_tokens,
            contended=trainer_factor, contended_batch=CONTENDED_BATCH, step=trainer_fit,
        )
        lengths = LengthModel.parse(str(out_a / "trace.json"), rho=0.5)
        print(f"trainer profile: {trainer.fixed_s * 1e3:.1f} ms + {trainer.s_per_token * 1e6:.2f} us/model token "
              f"({trainer.layout}); x{trainer.contended:.2f} while decoding; "
              f"weights {trainer.weight_bytes / 1e6:.1f} MB")
        measured_b, _ = await run_real(b, out_b)
    return {"engine": engine, "trainer": trainer, "lengths": lengths, "prompt_len": prompt_len,
            "a": measured_a, "b": measured_b, "metrics_a": metrics_a}


def main(args: argparse.Namespace) -> None:
    m = asyncio.run(measure(args))
    lengths, prompt_len = m["lengths"], m["prompt_len"]

    def replay_a(engine_: EngineProfile, trainer_: TrainerProfile) -> list[dict]:
        return simulated(engine_, trainer_, lengths, prompt_len, 0, 8, args.steps)

    engine, trainer = fit_to_run(m["engine"], m["trainer"], replay_a, m["metrics_a"])
    print(f"fitted to run A: engine steps x{engine.decode_s(32) / m['engine'].decode_s(32):.2f}, "
          f"trainer {trainer.s_per_token * 1e6:.2f} us/model token")
    m["engine"], m["trainer"] = engine, trainer
    profiles = (engine, trainer, lengths, prompt_len)
    rows = {
        "A: max_lag 0, 8 groups (calibration)": (predict(*profiles, max_lag=0, groups=8, steps=args.steps), m["a"], 0),
        "B: max_lag 2, 4 groups": (predict(*profiles, max_lag=2, groups=4, steps=args.steps), m["b"], 2),
    }
    print(f"{'configuration':<38}{'steps/s sim':>12}{'real':>8}{'error':>8}{'trainer idle sim':>18}{'real':>8}"
          f"{'step s sim':>12}{'real':>8}{'gen tok/s sim':>15}{'real':>8}{'lag in flight sim':>19}{'real':>6}"
          f"{'in queue sim':>14}{'real':>6}{'lag sim':>9}{'real':>6}{'closed form':>13}")
    for name, (sim, real, max_lag) in rows.items():
        error = errors(sim, real)["steps_per_s_pct"]
        print(f"{name:<38}{sim['steps_per_s']:>12.2f}{real['steps_per_s']:>8.2f}{error:>+7.1f}%"
              f"{sim['trainer_idle']:>18.1%}{real['trainer_idle']:>8.1%}{sim['train_step_s']:>12.3f}"
              f"{real['train_step_s']:>8.3f}{sim['gen_tokens_per_s']:>15.0f}{real['gen_tokens_per_s']:>8.0f}"
              f"{sim['lag_in_flight']:>19.2f}{real['lag_in_flight']:>6.2f}{sim['lag_in_queue']:>14.2f}"
              f"{real['lag_in_queue']:>6.2f}{sim['lag_in_flight'] + sim['lag_in_queue']:>9.2f}"
              f"{real['lag_in_flight'] + real['lag_in_queue']:>6.2f}{admission_lag(max_lag, args.steps):>13.2f}")
    replay = errors(*rows["A: max_lag 0, 8 groups (calibration)"][:2])
    predicted = errors(*rows["B: max_lag 2, 4 groups"][:2])
    where = machine.describe().removeprefix("machine: ")
    if args.save_profile:
        lengths: LengthModel = m["lengths"]
        Calibration(
            engine=m["engine"], trainer=m["trainer"], lengths=list(lengths.empirical or []),
            prompt_tokens=m["prompt_len"], machine=where, replay=replay, predicted=predicted,
        ).save(Path(args.save_profile))
        print(f"calibration saved to {args.save_profile} (python -m rollflow simulate --profile {args.save_profile})")
    print(machine.describe())
    print(f"RESULT sim_error_pct={abs(predicted['steps_per_s_pct']):.1f} "
          f"replay_error_pct={abs(replay['steps_per_s_pct']):.1f} "
          f"replay_idle_pts={abs(replay['trainer_idle_pts']):.1f} "
          f"predicted_idle_pts={abs(predicted['trainer_idle_pts']):.1f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--save-profile", metavar="FILE", help="keep the calibration (profiles and errors) as JSON")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", str(ENGINE_CORE))
    main(args)
