"""rollflow beside TRL's GRPOTrainer, step for step: the same task, model, batch and completion length.

Each model is trained three times, one run at a time on the same machine: by TRL 1.16's
`GRPOTrainer` (in TRL's own environment, `bin/dev bench-env trl`, driving bench/trl_grpo.py), and
by rollflow asynchronously (`run.max_lag = 1`) and synchronously (`run.max_lag = 0`). Every run
takes 2 prompts x 8 completions per step of the arithmetic task's questions (the same questions,
in the same order), rewards the digits a completion holds, and makes every completion exactly
`T` tokens long (rollflow: `sampling.ignore_eos`; TRL: `min_new_tokens`), so the work per step
does not change as the policy learns; one torch thread per process (rollflow's engine on core 0,
its controller and trainer on core 1, as in bench/overlap.py; TRL generates and trains in one
process).

The models: `tiny`, a tiny random Qwen2-shaped model (rollflow's tiny model's sizes and tokenizer,
with Qwen2's attention biases) at T = 32, and `smollm2`, SmolLM2-135M-Instruct at T = 128.

A step's time is the wall time between the ends of two optimizer steps (generation, scoring,
training, weight push and whatever else a trainer does per step); the median of steps 3..N is
reported, with the completion tokens per step. Ratios are rollflow's speedup over TRL: TRL's step
time / rollflow's (`_step`), and rollflow's tokens per second / TRL's (`_token`). The last line:

    RESULT tiny_async_step=<x> tiny_async_token=<x> tiny_sync_step=<x> tiny_sync_token=<x>
        smollm2_async_step=<x> ... smollm2_sync_token=<x>

    bin/dev python bench/vs_trl.py [--models tiny,smollm2] [--steps N] [--keep DIR] [--precision bf16]

`--precision bf16` runs both sides in bfloat16 mixed precision, generation included: TRL's
`bf16=True` (float32 weights and optimizer; its model's forward, and so its `generate` and its
LM head's logits, under bfloat16 autocast), rollflow's `trainer.autocast = "bfloat16"` with
the head's forward in bfloat16 too (`trainer.autocast_head`: shifted products, finer than
logits rounded whole) and the engine holding its copy of the weights in bfloat16
(`model.dtype`; each push cast on the way in, the fingerprint checked in that dtype). float32,
the default, runs everything in float32.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import machine
from overlap import CONTROLLER_CORE, ENGINE_CORE, pin  # the same cores as bench/overlap.py

from rollflow import load_config, train
from rollflow.models.cache import build_once, cache_root

ROOT = Path(__file__).resolve().parent.parent
GROUPS, GROUP_SIZE = 2, 8
MODELS = {"tiny": {"tokens": 32, "preset": "tiny"}, "smollm2": {"tokens": 128, "preset": "default"}}
LR = 1e-5
"""Both sides' learning rate (small: the benchmark times steps, it does not need them to learn)."""


def tiny_qwen2() -> Path:
    """A tiny random Qwen2-shaped model: rollflow's tiny model's sizes and tokenizer, built once."""

    def build(out: Path) -> None:
        import torch
        from transformers import Qwen2Config, Qwen2ForCausalLM

        from rollflow.models import load_tokenizer, tiny_model_path
        from rollflow.models import tiny as t

        tokenizer = load_tokenizer(tiny_model_path(0))
        config = Qwen2Config(
            vocab_size=len(tokenizer), hidden_size=t.HIDDEN_SIZE, intermediate_size=t.INTERMEDIATE_SIZE,
            num_hidden_layers=t.NUM_LAYERS, num_attention_heads=t.NUM_HEADS, num_key_value_heads=t.NUM_KV_HEADS,
            max_position_embeddings=t.MAX_POSITIONS, tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id, bos_token_id=None, dtype="float32",
        )  # fmt: skip
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(config)
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for param in model.parameters():
                if param.ndim == 2:
                    param.copy_(torch.randn(param.shape, generator=generator) * t.WEIGHT_STD)
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.save_pretrained(out, safe_serialization=True)
        tokenizer.save_pretrained(out)

    return build_once(cache_root() / "models" / "bench-tiny-qwen2-b1", build)


def model_path(name: str) -> Path:
    from rollflow.models import resolve_model

    return tiny_qwen2() if name == "tiny" else resolve_model("smollm2-135m-instruct")


def questions(config, n: int) -> list[str]:
    """The first `n` questions rollflow's sampler draws for `config`, as user messages."""
    from rollflow.sampler import Sampler

    sampler = iter(Sampler(config.data, lambda messages: [0]))
    return [next(sampler).messages[-1].content for _ in range(n)]


def summary(ends: list[float], tokens: list[float]) -> dict[str, float]:
    """Median step time of steps 3..N (from the end of step 2) and median tokens per step."""
    steps = [b - a for a, b in itertools.pairwise(ends[1:])]
    return {"step_s": statistics.median(steps), "tokens": statistics.median(tokens[2:] or tokens)}


def run_trl(path: Path, prompts: list[str], steps: int, tokens: int, precision: str) -> dict[str, float]:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(prompts, f)
    command = [str(ROOT / "bin" / "dev"), "bench-env", "trl", str(ROOT / "bench" / "trl_grpo.py"), "--model", str(path),
               "--prompts", f.name, "--steps", str(steps), "--tokens", str(tokens), "--lr", str(LR),
               "--groups", str(GROUPS), "--group-size", str(GROUP_SIZE)]  # fmt: skip
    if precision == "bf16":
        command.append("--bf16")
    try:
        one_thread = os.environ | {"OMP_NUM_THREADS": "1"}
        done = subprocess.run(command, capture_output=True, text=True, check=False, env=one_thread)
    finally:
        os.unlink(f.name)
    if done.returncode != 0:
        sys.exit(f"the TRL side failed ({done.returncode}):\n{done.stderr[-4000:]}")
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    result = summary(answer["ends"], answer["tokens"])
    result["version"] = answer["trl"]
    return result


async def run_rollflow(
    name: str, path: Path, steps: int, tokens: int, max_lag: int, keep: str | None, precision: str
) -> dict[str, float]:
    import torch

    torch.set_num_threads(1)
    config = load_config(
        preset=MODELS[name]["preset"],
        overrides=[
            f"model.path={path}",
            f"run.max_lag={max_lag}",
            f"run.max_steps={steps}",
            f"run.groups_per_step={GROUPS}",
            f"rollout.group_size={GROUP_SIZE}",
            f"sampling.max_tokens={tokens}",
            "sampling.ignore_eos=true",
            "run.reward=digits",
            f"trainer.lr={LR}",
            "engine.threads=1",
            "run.eval_prompts=0",
            "checkpoint.final_model=false",
            *(["trainer.autocast=bfloat16", "trainer.autocast_head=true", "model.dtype=bfloat16"]
              if precision == "bf16" else []),
        ],
    )
    pin(ENGINE_CORE)  # the engine process spawned at start inherits this core

    def on_step(_row: dict) -> None:
        pin(CONTROLLER_CORE)

    with tempfile.TemporaryDirectory() as scratch:
        out = Path(keep) / f"{name}-lag{max_lag}" if keep else scratch
        result = await train(config, out, on_step=on_step)
    ends = [m["wall_s"] for m in result.metrics]
    return summary(ends, [float(m["tokens"]) for m in result.metrics])


async def main(args: argparse.Namespace) -> None:
    print(machine.describe())
    figures: dict[str, float] = {}
    print(f"{'model':<9}{'run':<16}{'step s':>9}{'tokens':>8}{'tokens/s':>10}{'step ratio':>12}{'token ratio':>13}")
    for name in args.models.split(","):
        tokens = MODELS[name]["tokens"]
        path = model_path(name)
        config = load_config(preset=MODELS[name]["preset"], overrides=[f"model.path={path}"])
        prompts = questions(config, GROUPS * (args.steps + 2))
        began = time.monotonic()
        trl = run_trl(path, prompts, args.steps, tokens, args.precision)
        rows = [(f"TRL {trl['version']}", trl, None)]
        for mode, lag in (("async", 1), ("sync", 0)):
            mine = await run_rollflow(name, path, args.steps, tokens, lag, args.keep, args.precision)
            step = trl["step_s"] / mine["step_s"]
            token = (mine["tokens"] / mine["step_s"]) / (trl["tokens"] / trl["step_s"])
            figures[f"{name}_{mode}_step"], figures[f"{name}_{mode}_token"] = step, token
            rows.append((f"rollflow {mode}", mine, (step, token)))
        for label, r, ratios in rows:
            shown = f"{ratios[0]:>12.2f}{ratios[1]:>13.2f}" if ratios else ""
            rate = r["tokens"] / r["step_s"]
            print(f"{name:<9}{label:<16}{r['step_s']:>9.3f}{r['tokens']:>8.0f}{rate:>10.0f}{shown}")
        print(f"{name}: T = {tokens}, {GROUPS} prompts x {GROUP_SIZE} per step, {args.steps} steps, {args.precision}, "
              f"{time.monotonic() - began:.0f} s")  # fmt: skip
    print("ratios: rollflow's speedup over TRL (step: TRL's step time / rollflow's; token: tokens/s over TRL's)")
    print("RESULT " + " ".join(f"{k}={v:.2f}" for k, v in figures.items()))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny,smollm2")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--keep", default=None, help="keep rollflow's run folders here")
    parser.add_argument(
        "--precision", choices=["float32", "bf16"], default="float32",
        help="bf16: both sides in bfloat16 mixed precision, generation included (TRL's bf16=True; rollflow's "
        "trainer.autocast and a bfloat16 engine), float32 weights and optimizer on both sides",
    )
    asyncio.run(main(parser.parse_args()))
