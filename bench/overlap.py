"""Overlap: the same training workload run synchronously (max_lag 0) and asynchronously, side by side.

Both runs use the same model, prompts, reward, batch and number of steps, with every completion
exactly `--max-tokens` long (`sampling.ignore_eos`, so the work per step does not change as the
policy learns), the vLLM engine bound to core 0 and the controller + trainer to core 1 (one thread
each: on 2 cores, two OpenMP threads per process slow everything down). Steady state is measured
from the end of the first step to the end of the last (engine start and warm-up excluded). Prints
wall time, trainer idle fraction (waiting for a batch) and engine idle fraction (no request
generating) for both, the event loop's CPU time (it also runs vLLM's client-side token
processing, and shares core 1 with the trainer), the speedup, and last
`RESULT overlap_speedup=<x> overlap_efficiency=<e> trainer_idle_async=<y> max_tokens=<n>`.

Overlap pays most when generation and training take the same time, and how long each takes
depends on the CPU. So by default the benchmark first calibrates on the machine at hand: a
4-step synchronous run at the workload's size measures both stages, and the completion length
is set to balance them (`--no-calibrate`, or an explicit `--max-tokens`, keeps the size). The
efficiency is the measured speedup ÷ the ideal one from the synchronous run's own stage times,
(generate + train) / max(generate, train): it says how much of the available overlap rollflow
realised, whatever the balance of this machine.

Workloads (`--workload`; the other flags override their sizes):

- `smollm2` (default): SmolLM2-135M-Instruct (the `default` preset's model), 2 groups x 4 samples
  x 96 tokens per step, a one-line system prompt, 10 steps; generation and training each take
  about 9 s a step here. About 9 minutes in all.
- `tiny`: the tiny random model, 8 groups x 4 samples x 64 tokens and a 400-character shared
  system prompt, 24 steps; about 1.5 minutes. Its compute per token is so small that the
  controller's per-token work is a fifth of the trainer's core, which caps the speedup near 1.75
  on 2 cores (see the README).

    bin/dev python bench/overlap.py [--workload smollm2|tiny] [--steps N] [--groups N] [--group-size N]
        [--max-tokens N] [--system-chars N] [--max-lag 2] [--keep DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import tempfile
import time
from pathlib import Path

import machine

from rollflow.config import Config, load_config
from rollflow.controller import train

ENGINE_CORE, CONTROLLER_CORE = 0, 1
WORKLOADS = {
    "smollm2": {"preset": "default", "steps": 10, "groups": 2, "group_size": 4, "max_tokens": 96, "system_chars": 23},
    "tiny": {"preset": "tiny", "steps": 24, "groups": 8, "group_size": 4, "max_tokens": 64, "system_chars": 400},
}
SYSTEM_WORDS = "Answer with the number. " + " ".join(["think step by step then answer with the number"] * 40)
"""A shared system prompt, cut to `--system-chars`. A long one shifts work towards the trainer,
which pays for every prompt token while generation prefills it once (prefix caching shares it);
a short one (SmolLM2's: "Answer with the number.") replaces the model's longer default."""


def pin(core: int) -> None:
    """Bind every thread of this process to one core (threads started later inherit it)."""
    if not hasattr(os, "sched_setaffinity") or (os.cpu_count() or 1) < 2:
        return
    for tid in os.listdir("/proc/self/task"):
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
        ],
    )


async def one(max_lag: int, args: argparse.Namespace) -> dict[str, float]:
    config = config_of(args, max_lag)
    pin(ENGINE_CORE)  # the engine process spawned at start inherits this core
    cpu_s: list[float] = []

    def on_step(_row: dict) -> None:
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


def balanced_tokens(gen_s: float, train_s: float, tokens: int, prompt: int) -> int:
    """Completion length at which generation and training take the same time per step.

    Generation is taken as proportional to completion tokens (decoding dominates), training as
    proportional to prompt + completion tokens (each sample's prompt is trained on again); a
    machine whose engine is slow per token gets shorter completions, one whose trainer is slow
    gets longer ones."""
    g = gen_s / tokens  # seconds per completion token, generating
    k = train_s / (prompt + tokens)  # seconds per token, training
    if g <= k:  # generation is always cheaper: the longest completions come closest
        return 4 * tokens
    return max(16, min(4 * tokens, round(k * prompt / (g - k))))


async def calibrate(args: argparse.Namespace) -> None:
    """A short synchronous run at the workload's size, then `args.max_tokens` set to balance it."""
    quick = argparse.Namespace(**{**vars(args), "steps": 4, "keep": None})
    r = await one(0, quick)
    gen_s, train_s = stage_times(r)
    prompt = prompt_tokens(config_of(args))
    args.max_tokens = balanced_tokens(gen_s, train_s, args.max_tokens, prompt)
    print(f"calibration (synchronous, {quick.steps} steps of {quick.max_tokens} tokens, prompts ~{prompt:.0f} "
          f"tokens): generate {gen_s:.2f} s, train {train_s:.2f} s a step -> max_tokens={args.max_tokens}")


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
    # binds its OpenMP thread there; after the first step this process (controller loop and
    # trainer thread) moves to core 1.
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", str(ENGINE_CORE))
    asyncio.run(main(args))
