"""Overlap: the same training workload run synchronously (max_lag 0) and asynchronously, side by side.

Both runs use the same model, prompts, reward, batch and number of steps, with every completion
exactly `--max-tokens` long (`sampling.ignore_eos`, so the work per step does not change as the
policy learns), one thread each (on 2 cores, two OpenMP threads per process slow everything down):
the vLLM engine and the controller's event loop on core 0, the trainer's thread alone on core 1
(`run.trainer_cpus`); `--loop-core trainer` puts the loop beside the trainer instead. The loop also
runs vLLM's client-side token processing, which waits on the engine's outputs: beside the engine it
fills the engine's gaps, beside the trainer it takes the trainer's time. Steady state is measured
from the end of the first step to the end of the last (engine start and warm-up excluded). Prints
wall time, trainer idle fraction (waiting for a batch) and engine idle fraction (no request
generating) for both, the event loop's CPU time, the speedup, and last
`RESULT overlap_speedup=<x> overlap_efficiency=<e> trainer_idle_async=<y> max_tokens=<n>`.

Overlap pays most when generation and training take about the same time, and how long each
takes depends on the CPU. So by default the benchmark first calibrates on the machine at hand:
two 4-step synchronous runs at the workload's size (completions of its length and of half of it)
fit each stage's time as a fixed part plus a part per token (generation per completion token,
training per token the trainer's layout puts through the model: each group's prompt once), and
the completion length is set so that generation takes 0.8 of training (the two slow each other
down when they run together, so aiming under balance keeps the trainer busy); where no length
does (generating is cheaper per token than training), completions four times the groups'
prompt tokens keep most of the overlap without the slowest steps. The steps are then cut so the
two runs fit about 10 minutes (`--no-calibrate`, or an explicit `--max-tokens`, keeps the size).
The efficiency is the measured speedup ÷ the ideal one from the synchronous run's own stage
times, (generate + train) / max(generate, train): it says how much of the available overlap
rollflow realised, whatever the balance of this machine.

Workloads (`--workload`; the other flags override their sizes):

- `smollm2` (default): SmolLM2-135M-Instruct (the `default` preset's model), 2 groups x 4 samples
  per step, a one-line system prompt, 10 steps (fewer if they would not fit).
- `tiny`: the tiny random model, 8 groups x 4 samples and a 1,600-character shared system prompt
  (training pays for each group's prompt, generation finds it in the prefix cache: a long one
  lets training keep up with a model this small), 24 steps; about 2 minutes.

    bin/dev python bench/overlap.py [--workload smollm2|tiny] [--steps N] [--groups N] [--group-size N]
        [--max-tokens N] [--system-chars N] [--max-lag 2] [--loop-core engine|trainer] [--keep DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import tempfile
import threading
import time
from pathlib import Path

import machine

from rollflow.config import Config, load_config
from rollflow.controller import train
from rollflow.sim.calibrate import fit_line

ENGINE_CORE, CONTROLLER_CORE = 0, 1
TRAINER_THREAD = "rollflow-trainer"
"""The name of the trainer's thread (`rollflow.controller.trainer_thread`)."""
WORKLOADS = {
    "smollm2": {"preset": "default", "steps": 10, "groups": 2, "group_size": 4, "max_tokens": 96, "system_chars": 23},
    "tiny": {"preset": "tiny", "steps": 24, "groups": 8, "group_size": 4, "max_tokens": 64, "system_chars": 1600},
}
SYSTEM_WORDS = "Answer with the number. " + " ".join(["think step by step then answer with the number"] * 40)
"""A shared system prompt, cut to `--system-chars`. A long one shifts work towards the trainer,
which pays for every prompt token while generation prefills it once (prefix caching shares it);
a short one (SmolLM2's: "Answer with the number.") replaces the model's longer default."""


def pin(core: int, *, but_trainer: bool = False) -> None:
    """Bind every thread of this process to one core (threads started later inherit it);
    `but_trainer`: all but the trainer's thread, which `run.trainer_cpus` binds."""
    if not hasattr(os, "sched_setaffinity") or (os.cpu_count() or 1) < 2:
        return
    trainer = {t.native_id for t in threading.enumerate() if but_trainer and t.name.startswith(TRAINER_THREAD)}
    for tid in os.listdir("/proc/self/task"):
        if int(tid) in trainer:
            continue
        with contextlib.suppress(OSError):  # a thread that just ended
            os.sched_setaffinity(int(tid), {core})


def prompt_tokens(config: Config, n: int = 32) -> float:
    """Mean prompt length of the run's first `n` prompts, encoded as the run encodes them."""
    from rollflow.models import load_tokenizer, prompt_encoder, resolve_model
    from rollflow.sampler import Sampler

    tokenizer = load_tokenizer(resolve_model(config.model.path))
    sampler = iter(Sampler(config.data, prompt_encoder(tokenizer, config.data)))
    return sum(len(next(sampler).token_ids) for _ in range(n)) / n


def config_of(args: argparse.Namespace, max_lag: int = 0) -> Config:
    return load_config(
        preset=args.preset,
        overrides=[
            f"run.max_lag={max_lag}",
            f"run.max_steps={args.steps}",
            f"run.groups_per_step={args.groups}",
            f"rollout.group_size={args.group_size}",
            f"sampling.max_tokens={args.max_tokens}",
            "sampling.ignore_eos=true",
            f"trainer.micro_batch_tokens={args.micro_batch_tokens}",
            f"data.system_prompt='{SYSTEM_WORDS[: args.system_chars]}'",
            "run.eval_prompts=0",
            "checkpoint.final_model=false",
            *([f"run.trainer_cpus=[{CONTROLLER_CORE}]"] if args.loop_core == "engine" else []),
        ],
    )


async def one(max_lag: int, args: argparse.Namespace) -> dict[str, float]:
    config = config_of(args, max_lag)
    pin(ENGINE_CORE)  # the engine process spawned at start inherits this core
    cpu_s: list[float] = []

    def on_step(_row: dict) -> None:
        if args.loop_core == "engine":
            pin(ENGINE_CORE, but_trainer=True)
        else:
            pin(CONTROLLER_CORE)
        cpu_s.append(time.thread_time())  # on_step runs on the event loop's thread

    with tempfile.TemporaryDirectory() as scratch:
        out = Path(args.keep) / ("synchronous" if max_lag == 0 else "asynchronous") if args.keep else scratch
        result = await train(config, out, on_step=on_step)
    steady = result.metrics[1:]
    first, last = result.metrics[0], result.metrics[-1]
    wall = last["wall_s"] - first["wall_s"]
    busy = last["engine_busy_s"] - first["engine_busy_s"]
    waited = sum(m["batch_wait_s"] for m in steady)
    train_s = sum(m["train_step_s"] for m in steady)
    sync_s = sum(m["weight_sync_s"] for m in steady)
    load_s = sum(m["engine_update_s"] for m in steady)
    return {
        "wall_s": wall,
        "steps": len(steady),
        "wait_s": waited,
        "trainer_idle": waited / wall if wall > 0 else 0.0,
        "engine_idle": max(0.0, 1.0 - busy / wall) if wall > 0 else 0.0,
        "train_s": train_s,
        "sync_s": sync_s,
        "load_s": load_s,
        "loop_cpu": (cpu_s[-1] - cpu_s[0]) / wall if wall > 0 else 0.0,
        "reward_last": result.metrics[-1]["reward_mean"],
        "lag_mean": sum(m["lag_mean"] for m in steady) / len(steady),
    }


def stage_times(r: dict[str, float]) -> tuple[float, float]:
    """(generation, training) seconds per steady step of a synchronous run: its trainer waits for
    each batch while the engine generates it, then trains while the engine waits."""
    return r["wait_s"] / r["steps"], r["train_s"] / r["steps"]


GENERATION_SHARE = 0.8
"""Calibration aims generation at this share of training in the synchronous run: running side by
side in the asynchronous run, the two share the machine and generation slows down, so aiming a
little under balance keeps the trainer from waiting for batches."""

BUDGET_S = 600.0
"""Seconds the two measured runs may take together, estimated from the calibration: past it the
steps are cut (to no fewer than `MIN_STEPS`), so the benchmark ends within a quarter hour."""

MIN_STEPS = 6


def balanced_tokens(
    gen: tuple[float, float], train: tuple[float, float], limit: int, prompt: float, groups: int, samples: int
) -> tuple[int, bool]:
    """The completion length at which generation takes `GENERATION_SHARE` of training per step,
    and whether one exists up to `limit`.

    `gen` and `train` are each stage's seconds per step as a fixed part and a part per token
    (fitted to two calibration runs): generation per completion token of the step, training per
    token the trainer's layout puts through the model, each group's prompt once and every
    completion (`shared_prompt`, the default). When no length up to `limit` balances them
    (generating is cheaper per token than training and its fixed part is not enough), the
    length is where the generation's share comes closest without the longest, slowest steps:
    completions four times the groups' prompt tokens, at most `limit`."""
    (gen_fixed, gen_per), (train_fixed, train_per) = gen, train
    r = GENERATION_SHARE
    # gen_fixed + gen_per·S·T = r·(train_fixed + train_per·(G·P + S·T))
    slope = samples * (gen_per - r * train_per)
    level = r * (train_fixed + train_per * groups * prompt) - gen_fixed
    if slope > 0 and level > 0 and level / slope <= limit:
        return max(16, round(level / slope)), True
    if slope < 0 and level < 0:  # generation too slow even at the shortest: longer helps training catch up
        return max(16, min(limit, round(level / slope))), level / slope <= limit
    return max(16, min(limit, round(4 * groups * prompt / samples))), False


def step_estimate(gen: tuple[float, float], train: tuple[float, float], length: int, prompt: float, groups: int,
                  samples: int) -> float:
    """A synchronous step's seconds at completions of `length`, from the fitted stage times."""
    return gen[0] + gen[1] * samples * length + train[0] + train[1] * (groups * prompt + samples * length)


def fit_two(x1: float, y1: float, x2: float, y2: float) -> tuple[float, float]:
    """The line through two points, (intercept, slope), the intercept kept at 0 or above."""
    intercept, slope = fit_line([x1, x2], [y1, y2])
    if intercept < 0:
        return 0.0, y2 / x2
    return intercept, max(slope, 0.0)


async def calibrate(args: argparse.Namespace) -> None:
    """Two short synchronous runs at the workload's size, with completions of its length and of
    half of it; each stage's time fitted as a fixed part plus a part per token; then
    `args.max_tokens` set to balance them and `args.steps` cut to fit `BUDGET_S`."""
    prompt = prompt_tokens(config_of(args))
    samples = args.groups * args.group_size
    lengths = (max(16, args.max_tokens // 2), args.max_tokens)
    points = []
    for length in lengths:
        quick = argparse.Namespace(**{**vars(args), "steps": 4, "keep": None, "max_tokens": length})
        points.append(stage_times(await one(0, quick)))
    (g1, t1), (g2, t2) = points
    gen = fit_two(samples * lengths[0], g1, samples * lengths[1], g2)
    train = fit_two(args.groups * prompt + samples * lengths[0], t1, args.groups * prompt + samples * lengths[1], t2)
    args.max_tokens, found = balanced_tokens(gen, train, 4 * lengths[1], prompt, args.groups, samples)
    step = step_estimate(gen, train, args.max_tokens, prompt, args.groups, samples)
    fits = int(BUDGET_S / (step * 1.7))  # the synchronous run, and the asynchronous one at ~0.7 of it
    if fits < args.steps:
        args.steps = max(MIN_STEPS, fits)
    how = f"generation at {GENERATION_SHARE} of training" if found else "no balance: closest without the longest"
    print(f"calibration (synchronous, 4 steps each of {lengths[0]} and {lengths[1]} tokens, prompts ~{prompt:.0f} "
          f"tokens): generate {g1:.2f} / {g2:.2f} s, train {t1:.2f} / {t2:.2f} s a step -> "
          f"max_tokens={args.max_tokens} ({how}), {args.steps} steps of about {step:.1f} s")


async def main(args: argparse.Namespace) -> None:
    if args.calibrate:
        await calibrate(args)
    rows = {}
    for name, lag in (("synchronous (max_lag 0)", 0), (f"asynchronous (max_lag {args.max_lag})", args.max_lag)):
        rows[name] = await one(lag, args)
    print(
        f"workload={args.workload} preset={args.preset} steps={args.steps} groups/step={args.groups} "
        f"group_size={args.group_size} max_tokens={args.max_tokens} system_chars={args.system_chars}"
    )
    print(f"{'mode':<26}{'wall s':>8}{'trainer idle':>14}{'engine idle':>13}{'train s':>9}{'sync s':>8}"
          f"{'load s':>8}{'lag':>6}{'loop cpu':>10}")
    for name, r in rows.items():
        print(f"{name:<26}{r['wall_s']:>8.2f}{r['trainer_idle']:>14.1%}{r['engine_idle']:>13.1%}"
              f"{r['train_s']:>9.2f}{r['sync_s']:>8.2f}{r['load_s']:>8.2f}{r['lag_mean']:>6.2f}{r['loop_cpu']:>10.1%}")
    print("train s: trainer steps; sync s: the trainer's wait to stage weights; load s: the engine's weight loads")
    print("loop cpu: CPU time of the controller's event loop (which runs vLLM's client too) per wall second")
    sync, asyn = rows["synchronous (max_lag 0)"], rows[f"asynchronous (max_lag {args.max_lag})"]
    speedup = sync["wall_s"] / asyn["wall_s"]
    gen_s, train_s = stage_times(sync)
    # Perfect overlap hides the shorter stage entirely: a step takes the longer one.
    ideal = (gen_s + train_s) / max(gen_s, train_s)
    print(f"synchronous stages: generate {gen_s:.2f} s + train {train_s:.2f} s a step; ideal overlap "
          f"speedup {ideal:.2f}")
    print(machine.describe())
    print(f"RESULT overlap_speedup={speedup:.2f} overlap_efficiency={speedup / ideal:.2f} "
          f"trainer_idle_async={asyn['trainer_idle']:.3f} max_tokens={args.max_tokens}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="smollm2")
    parser.add_argument("--steps", type=int)
    parser.add_argument("--groups", type=int, help="groups per step")
    parser.add_argument("--group-size", type=int)
    parser.add_argument("--max-tokens", type=int, help="tokens per completion (all completions this long)")
    parser.add_argument("--system-chars", type=int, help="characters of a shared system prompt")
    parser.add_argument("--max-lag", type=int, default=2)
    parser.add_argument(
        "--calibrate", action=argparse.BooleanOptionalAction, default=None,
        help="pick the completion length that balances generation and training on this machine "
        "(default: on unless --max-tokens is given)",
    )
    parser.add_argument("--micro-batch-tokens", type=int, default=8192)
    parser.add_argument(
        "--loop-core", choices=("engine", "trainer"), default="engine",
        help="the core of the controller's event loop (vLLM's client): beside the engine, the trainer "
        "thread alone on the other core (run.trainer_cpus; default), or beside the trainer",
    )
    parser.add_argument(
        "--keep", metavar="DIR", help="keep both runs' output in DIR/synchronous and DIR/asynchronous "
        "(then `python -m rollflow plot DIR/synchronous DIR/asynchronous` draws their timelines)"
    )
    args = parser.parse_args()
    if args.calibrate is None:
        args.calibrate = args.max_tokens is None
    for key, value in WORKLOADS[args.workload].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    # The engine process (spawned at start, while this process sits on core 0) keeps core 0 and
    # binds its OpenMP thread there; after the first step the controller's loop stays there (or,
    # with --loop-core trainer, moves to core 1 with the trainer thread).
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", str(ENGINE_CORE))
    asyncio.run(main(args))
