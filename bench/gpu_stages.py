"""The GPU check's stages (`bench/gpu_check.py` runs each as `--stage NAME`, in a process of its
own): each measures one CUDA path of the trainer and returns its figures. What each one measures
is in gpu_check.py's docstring."""

from __future__ import annotations

import os
import sys
import tempfile
import time
from importlib import metadata
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

DRY = os.environ.get("ROLLFLOW_GPU_CHECK_DRY") == "1"
"""A dry run on the CPU (the unit tests' check of the stages' code): small sizes, a 2-layer
SmolLM2, gloo for the process group, no memory figures and no liger-kernel (Triton needs CUDA)."""


DRY_MODEL = {"num_hidden_layers": 2, "vocab_size": 4096}
"""What the dry run makes smaller of SmolLM2 (its embedding dominates a 2-layer model's size, and
the loss stage's cost)."""


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
            module = __import__(name)
            versions[name] = getattr(module, "__version__", None) or metadata.version(name.replace("_", "-"))
        except Exception as err:  # a missing package is what this stage reports
            versions[name] = f"missing ({type(err).__name__})"
    return {"device": props.name, "memory_gib": round(props.total_memory / 2**30, 1),
            "multiprocessors": props.multi_processor_count, **versions}


def _timed(torch: Any, run: Any, repeats: int = 5, warmup: int = 2) -> tuple[float, int]:
    """(seconds per call, peak bytes allocated above what was allocated before) of `run()`; the
    dry run calls it once (its figures mean nothing)."""
    if DRY:
        repeats, warmup = 1, 0
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
    """Log-probs of `targets` through the trainer's fused head (liger-kernel's fused linear
    cross entropy, `rollflow.trainer.heads`: what a CUDA trainer with trainer.fused_loss runs)."""
    from rollflow.trainer.heads import fused_logprobs

    return fused_logprobs(hidden, weight, targets, temperature)


def stage_loss() -> dict[str, Any]:
    torch = _cuda()
    from rollflow.loss import naive_token_logprobs, token_logprobs

    n, h = (512 if DRY else 16384), SMOLLM2["hidden_size"]
    v = DRY_MODEL["vocab_size"] if DRY else SMOLLM2["vocab_size"]
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
    from rollflow.config import TrainerConfig
    from rollflow.trainer import Trainer
    from rollflow.trainer.batches import model_tokens

    folder, batch = _smollm2_folder(torch), _grpo_batch()
    figures: dict[str, Any] = {"samples": len(batch.samples)}
    scored: dict[str, Any] = {}
    for layout in ("padded", "packed", "shared_prompt"):
        config = TrainerConfig(dtype="bfloat16", layout=layout, micro_batch_tokens=16384, lr=1e-6, fused_loss=False)
        trainer = Trainer(folder, config)
        tokens = model_tokens(batch.samples, config.micro_batch_tokens, layout)
        seconds, peak = _timed(torch, lambda t=trainer: t.step(batch), repeats=2, warmup=1)
        figures[f"{layout}_tokens_per_s"] = tokens / seconds
        figures[f"{layout}_mfu"] = 6 * _params(trainer) * tokens / seconds / BF16_PEAK
        figures[f"{layout}_peak_gib"] = peak / 2**30
        figures[f"{layout}_model_tokens"] = tokens
        if layout == "shared_prompt":
            scored["chunked"] = trainer.score(batch.samples)
            # The fused head (trainer.fused_loss, liger-kernel); the dry run (no CUDA) keeps the
            # chunked one and checks the bookkeeping.
            trainer.module.head = "chunked" if DRY else "fused"
            try:
                seconds_liger, peak_liger = _timed(torch, lambda t=trainer: t.step(batch), repeats=2, warmup=1)
                scored["liger"] = trainer.score(batch.samples)
            finally:
                trainer.module.head = "chunked"
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
