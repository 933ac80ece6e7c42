"""The GPU check's stages: each one measures a CUDA path of the trainer, in a process of its own.

`bench/gpu_check.sh` runs this file once as the driver (`drive`), which runs every stage as
`python bench/gpu_check.py --stage NAME` with its own time limit, so a stage that fails, crashes
the process or hangs (a CUDA error, an NCCL wait) is reported with its name and the next one
still runs; stages are skipped once the whole check has used `BUDGET_S`. Each stage prints one
JSON object, its figures, as its last line. The driver prints a table and, last,
`RESULT gpu_stages_ok=K/N ...` with the headline figures.

Stages:
- `machine`: the device, torch, triton and liger-kernel versions.
- `tests`: `pytest tests/gpu` (the CUDA tests the suite skips without a device).
- `loss`: the LM-head log-probs of 16,384 tokens × SmolLM2's vocabulary in bf16, forward and
  backward: rollflow's chunked path (`rollflow.loss.token_logprobs`), liger-kernel's fused linear
  cross entropy, and full logits; peak memory, tokens/s, and the log-probs' and gradients'
  agreement with the full-logits reference (relative to its scale).
- `layouts`: one bf16 training step of SmolLM2-135M's architecture through rollflow's `Trainer`
  in each layout (padded, packed, shared prompt) on a GRPO batch (8 groups of 8, 256-token
  prompts, completions lognormal mean 300 ≤ 1,024): model tokens/s, MFU and peak memory; then the
  shared-prompt step with liger-kernel's fused loss in place of the chunked one (what wiring it in
  would give), and the two steps' log-probs compared. The weights are random: SmolLM2's 270 MB
  of weights exceed what a device call carries, and speed, memory and agreement do not depend on
  their values.
- `fsdp`: the same step with the model sharded by FSDP2 over a one-rank NCCL group, and the
  weights gathered whole afterwards.
- `weight_update`: the trainer side of a weight update: the weights gathered and packed into the
  transfer buckets (`rollflow.weight_sync.buckets.pack_into`) in GPU memory and in pinned host
  memory, against one device-to-device copy of the same bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SMOLLM2 = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "hidden_act": "silu",
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"},
    "tie_word_embeddings": True,
    "vocab_size": 49152,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
}
"""SmolLM2-135M-Instruct's architecture (its config.json, as transformers 5 writes it)."""

BF16_PEAK = 989e12
"""Dense bf16 peak of an H100 / H200 SXM, FLOP/s (the MFU's denominator)."""

BUDGET_S = 420.0
"""Seconds the whole check may use; stages not started by then are reported skipped."""


@dataclass(frozen=True)
class Stage:
    name: str
    argv: list[str]
    timeout_s: float
    reports_json: bool = True
    """The stage prints its figures as JSON last; otherwise its exit status and last line are all."""


def stages() -> list[Stage]:
    me = [sys.executable, str(Path(__file__).resolve()), "--stage"]
    tests = [sys.executable, "-m", "pytest", "tests/gpu", "-q", "-p", "no:cacheprovider"]
    limits = {"machine": 60, "loss": 120, "layouts": 240, "fsdp": 150, "weight_update": 120}
    first = [Stage("machine", [*me, "machine"], limits.pop("machine")), Stage("tests", tests, 180, reports_json=False)]
    return first + [Stage(name, [*me, name], limit) for name, limit in limits.items()]


def run_stage(stage: Stage) -> dict[str, Any]:
    """One stage in its own process: its figures, or the reason it has none."""
    began = time.monotonic()
    try:
        done = subprocess.run(stage.argv, capture_output=True, text=True, timeout=stage.timeout_s, check=False)
    except subprocess.TimeoutExpired as err:
        tail = (err.stderr or b"")[-600:]
        tail = tail.decode(errors="replace") if isinstance(tail, bytes) else tail
        return {"ok": False, "why": f"timed out after {stage.timeout_s:g} s", "tail": tail, "s": stage.timeout_s}
    seconds = time.monotonic() - began
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    if not stage.reports_json:
        summary = lines[-1] if lines else ""
        if done.returncode != 0:
            return {"ok": False, "why": f"exit status {done.returncode}: {summary}", "tail": done.stdout[-1500:],
                    "s": seconds}
        return {"ok": True, "figures": {"summary": summary}, "s": seconds}
    if done.returncode != 0 or not lines:
        return {"ok": False, "why": f"exit status {done.returncode}", "tail": done.stderr[-1500:], "s": seconds}
    try:
        figures = json.loads(lines[-1])
    except json.JSONDecodeError:
        return {"ok": False, "why": "its last line is not JSON", "tail": lines[-1][-300:], "s": seconds}
    for line in lines[:-1]:
        print(f"  [{stage.name}] {line}")
    return {"ok": True, "figures": figures, "s": seconds}


def drive(plan: list[Stage], budget_s: float = BUDGET_S) -> dict[str, dict[str, Any]]:
    """Every stage in order, each bounded, each failure printed with its stage; the results."""
    began = time.monotonic()
    results: dict[str, dict[str, Any]] = {}
    for stage in plan:
        if time.monotonic() - began > budget_s:
            results[stage.name] = {"ok": False, "why": f"skipped: the check's {budget_s:g} s were used", "s": 0.0}
        else:
            print(f"stage {stage.name} (at most {stage.timeout_s:g} s) ...", flush=True)
            results[stage.name] = run_stage(stage)
        result = results[stage.name]
        if result["ok"]:
            print(f"stage {stage.name}: ok in {result['s']:.1f} s: {json.dumps(result['figures'])}", flush=True)
        else:
            print(f"stage {stage.name}: FAILED ({result['why']})", flush=True)
            if result.get("tail"):
                print("  " + result["tail"].strip().replace("\n", "\n  "), flush=True)
    return results


HEADLINE = {
    "loss": ("liger_vs_chunked_tokens_per_s", "liger_vs_chunked_peak_mem", "chunked_logprob_err", "liger_logprob_err"),
    "layouts": ("shared_prompt_tokens_per_s", "shared_prompt_mfu", "packed_tokens_per_s", "padded_tokens_per_s",
                "liger_step_vs_chunked"),
    "fsdp": ("fsdp_step_s",),
    "weight_update": ("pack_gpu_vs_d2d", "pack_pinned_gbps", "d2d_gbps"),
}
"""The figures the RESULT line carries, by stage."""


def result_line(results: dict[str, dict[str, Any]]) -> str:
    ok = sum(r["ok"] for r in results.values())
    parts = [f"gpu_stages_ok={ok}/{len(results)}"]
    for stage, keys in HEADLINE.items():
        figures = results.get(stage, {}).get("figures", {})
        for key in keys:
            value = figures.get(key)
            parts.append(f"{key}={value:.4g}" if isinstance(value, (int, float)) else f"{key}=na")
    return "RESULT " + " ".join(parts)


# ---- the stages (each runs in its own process) ----------------------------------------------

DRY = os.environ.get("ROLLFLOW_GPU_CHECK_DRY") == "1"
"""A dry run on the CPU (the unit tests' check of the stages' code): small sizes, a 2-layer
SmolLM2, gloo for the process group, no memory figures and no liger-kernel (Triton needs CUDA)."""


DRY_MODEL = {"num_hidden_layers": 2, "vocab_size": 4096}
"""What the dry run makes smaller of SmolLM2 (its embedding dominates a 2-layer model's size)."""


def _cuda() -> Any:
    import torch

    if not DRY and not torch.cuda.is_available():
        raise SystemExit("no CUDA device")
    return torch


def _device() -> str:
    return "cpu" if DRY else "cuda"


def _sync(torch: Any) -> None:
    if not DRY:
        torch.cuda.synchronize()


def stage_machine() -> dict[str, Any]:
    torch = _cuda()
    versions: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda}
    if DRY:
        return {"device": "cpu (dry run)", **versions}
    props = torch.cuda.get_device_properties(0)
    for name in ("triton", "liger_kernel", "transformers", "msgspec"):
        try:
            versions[name] = __import__(name).__version__
        except Exception as err:  # a missing package is what this stage reports
            versions[name] = f"missing ({type(err).__name__})"
    return {"device": props.name, "memory_gib": round(props.total_memory / 2**30, 1),
            "multiprocessors": props.multi_processor_count, **versions}


def _timed(torch: Any, run: Any, repeats: int = 5, warmup: int = 2) -> tuple[float, int]:
    """(seconds per call, peak bytes allocated above what was allocated before) of `run()`."""
    for _ in range(warmup):
        run()
    _sync(torch)
    base = 0 if DRY else torch.cuda.memory_allocated()
    if not DRY:
        torch.cuda.reset_peak_memory_stats()
    began = time.perf_counter()
    for _ in range(repeats):
        run()
    _sync(torch)
    peak = 0 if DRY else torch.cuda.max_memory_allocated() - base
    return (time.perf_counter() - began) / repeats, peak


def _relative(got: Any, want: Any) -> float:
    """max |got - want| relative to want's largest magnitude (any summation order's scale)."""
    return float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-12))


def liger_logprobs(hidden: Any, weight: Any, targets: Any, temperature: float = 1.0) -> Any:
    """Log-probs of `targets` through liger-kernel's fused linear cross entropy (no top-k / top-p)."""
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    loss = LigerFusedLinearCrossEntropyLoss(reduction="none")
    return -loss(weight, hidden / temperature if temperature != 1.0 else hidden, targets)


def stage_loss() -> dict[str, Any]:
    torch = _cuda()
    from rollflow.loss import naive_token_logprobs, token_logprobs

    n, h, v = (512 if DRY else 16384), SMOLLM2["hidden_size"], SMOLLM2["vocab_size"]
    device = _device()
    g = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(n, h, device=device, generator=g).bfloat16().requires_grad_()
    weight = (torch.randn(v, h, device=device, generator=g) * 0.05).bfloat16().requires_grad_()
    targets = torch.randint(0, v, (n,), device=device, generator=g)
    paths = {
        "chunked": lambda: token_logprobs(hidden, weight, targets, chunk=1024)[0],
        "liger": lambda: liger_logprobs(hidden, weight, targets),
        "full": lambda: naive_token_logprobs(hidden, weight, targets),
    }
    if DRY:
        paths["liger"] = paths["chunked"]  # Triton needs CUDA: the dry run checks the bookkeeping
    figures: dict[str, Any] = {"tokens": n}
    values: dict[str, Any] = {}
    for name, path in paths.items():

        def step(path: Any = path) -> None:
            hidden.grad = weight.grad = None
            path().sum().backward()

        seconds, peak = _timed(torch, step)
        hidden.grad = weight.grad = None
        logprobs = path()
        logprobs.sum().backward()
        values[name] = (logprobs.detach(), weight.grad.detach().clone())
        figures[f"{name}_tokens_per_s"] = n / seconds
        figures[f"{name}_peak_mib"] = peak / 2**20
    want_lp, want_grad = values["full"]
    for name in ("chunked", "liger"):
        figures[f"{name}_logprob_err"] = _relative(values[name][0], want_lp)
        figures[f"{name}_grad_err"] = _relative(values[name][1], want_grad)
    figures["liger_vs_chunked_tokens_per_s"] = figures["liger_tokens_per_s"] / figures["chunked_tokens_per_s"]
    figures["liger_vs_chunked_peak_mem"] = figures["liger_peak_mib"] / max(figures["chunked_peak_mib"], 1e-9)
    return figures


def _smollm2_folder(torch: Any) -> Path:
    """SmolLM2-135M's architecture with random weights, saved as a model folder."""
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = Path(tempfile.mkdtemp(prefix="rollflow-gpu-check-"))
    config = AutoConfig.for_model(**(SMOLLM2 | (DRY_MODEL if DRY else {})))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


def _grpo_batch() -> Any:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from packing import make_batch  # bench/packing.py's GRPO batch

    if DRY:
        return make_batch(groups=2, group_size=2, prompt_len=16, vocab=DRY_MODEL["vocab_size"], seed=0, mean=8)
    return make_batch(groups=8, group_size=8, prompt_len=256, vocab=SMOLLM2["vocab_size"], seed=0)


def _params(trainer: Any) -> int:
    return sum(p.numel() for p in trainer.lm.parameters())


def stage_layouts() -> dict[str, Any]:
    torch = _cuda()
    import rollflow.trainer.batches as batches
    from rollflow.config import TrainerConfig
    from rollflow.loss import token_logprobs as chunked
    from rollflow.trainer import Trainer
    from rollflow.trainer.batches import model_tokens

    folder, batch = _smollm2_folder(torch), _grpo_batch()
    figures: dict[str, Any] = {"samples": len(batch.samples)}
    scored: dict[str, Any] = {}
    for layout in ("padded", "packed", "shared_prompt"):
        config = TrainerConfig(dtype="bfloat16", layout=layout, micro_batch_tokens=16384, lr=1e-6)
        trainer = Trainer(folder, config)
        tokens = model_tokens(batch.samples, config.micro_batch_tokens, layout)
        seconds, peak = _timed(torch, lambda t=trainer: t.step(batch), repeats=2, warmup=1)
        figures[f"{layout}_tokens_per_s"] = tokens / seconds
        figures[f"{layout}_mfu"] = 6 * _params(trainer) * tokens / seconds / BF16_PEAK
        figures[f"{layout}_peak_gib"] = peak / 2**30
        figures[f"{layout}_model_tokens"] = tokens
        if layout == "shared_prompt":
            scored["chunked"] = trainer.score(batch.samples)
            original = batches.token_logprobs

            def fused(hidden: Any, weight: Any, targets: Any, *, temperature: float = 1.0, **rest: Any) -> Any:
                if DRY:
                    return chunked(hidden, weight, targets, temperature=temperature, **rest)
                lp = liger_logprobs(hidden, weight, targets, temperature)
                return lp, torch.zeros_like(lp).detach()  # no entropy from the fused kernel

            batches.token_logprobs = fused
            try:
                seconds_liger, peak_liger = _timed(torch, lambda t=trainer: t.step(batch), repeats=2, warmup=1)
                scored["liger"] = trainer.score(batch.samples)
            finally:
                batches.token_logprobs = original
            scored["chunked_after"] = trainer.score(batch.samples)  # the same weights as "liger"
            figures["liger_step_tokens_per_s"] = tokens / seconds_liger
            figures["liger_step_peak_gib"] = peak_liger / 2**30
            figures["liger_step_vs_chunked"] = seconds / seconds_liger
        del trainer
        torch.cuda.empty_cache()
    flat = [torch.tensor(x) for x in scored["chunked_after"]]
    fused_lp = [torch.tensor(x) for x in scored["liger"]]
    figures["liger_step_logprob_err"] = _relative(torch.cat(fused_lp), torch.cat(flat))
    return figures


def stage_fsdp() -> dict[str, Any]:
    torch = _cuda()
    import torch.distributed as dist

    from rollflow.config import TrainerConfig
    from rollflow.trainer import Trainer

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        import socket

        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(probe.getsockname()[1])
    dist.init_process_group("gloo" if DRY else "nccl", rank=0, world_size=1)
    try:
        trainer = Trainer(_smollm2_folder(torch), TrainerConfig(dtype="bfloat16", micro_batch_tokens=16384))
        batch = _grpo_batch()
        sharded = type(trainer.module).__name__
        seconds, peak = _timed(torch, lambda: trainer.step(batch), repeats=2, warmup=1)
        whole = dict(trainer.full_weights())
        return {"module": sharded, "fsdp_step_s": seconds, "fsdp_peak_gib": peak / 2**30,
                "gathered_tensors": len(whole), "gathered_on": str(next(iter(whole.values())).device)}
    finally:
        dist.destroy_process_group()


def stage_weight_update() -> dict[str, Any]:
    torch = _cuda()
    from rollflow.config import TrainerConfig
    from rollflow.trainer import Trainer
    from rollflow.weight_sync.buckets import pack_into, plan_buckets

    trainer = Trainer(_smollm2_folder(torch), TrainerConfig(dtype="bfloat16"))
    plan = plan_buckets(trainer.weight_specs())
    total = plan.total_bytes
    on_gpu = torch.empty(total, dtype=torch.uint8, device=_device())
    pinned = torch.empty(total, dtype=torch.uint8, pin_memory=not DRY)
    source = torch.empty(total, dtype=torch.uint8, device=_device())
    gpu_s, _ = _timed(torch, lambda: pack_into(plan, trainer.full_weights(), on_gpu), repeats=3, warmup=1)
    pinned_s, _ = _timed(torch, lambda: pack_into(plan, trainer.full_weights(), pinned), repeats=3, warmup=1)
    d2d_s, _ = _timed(torch, lambda: on_gpu.copy_(source), repeats=10, warmup=2)
    gb = total / 1e9
    return {"bytes": total, "pack_gpu_gbps": gb / gpu_s, "pack_pinned_gbps": gb / pinned_s, "d2d_gbps": gb / d2d_s,
            "pack_gpu_vs_d2d": d2d_s / gpu_s}


STAGES = {
    "machine": stage_machine,
    "loss": stage_loss,
    "layouts": stage_layouts,
    "fsdp": stage_fsdp,
    "weight_update": stage_weight_update,
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", choices=sorted(STAGES), help="run one stage and print its figures as JSON")
    args = parser.parse_args()
    if args.stage:
        print(json.dumps(STAGES[args.stage]()), flush=True)
        return 0
    results = drive(stages())
    print(result_line(results))
    return 0 if all(r["ok"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
