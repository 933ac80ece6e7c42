"""One trainer rank's optimizer step: model, micro-batches, loss, AdamW, FSDP2, LoRA.

Plain torch, no asyncio; the controller calls `Trainer.step` from a worker thread. Every rank
receives the whole `TrainBatch`, takes its share (balanced by tokens), runs it in micro-batches
under a token budget with gradient accumulation, and normalises by the *whole batch's* counts,
so the step is the same whatever the number of ranks and micro-batches. With several ranks the
model is sharded with FSDP2 (`fully_shard`; it runs on CPU with gloo as well as on CUDA with
NCCL), and every rank runs the same number of forward/backward passes (ranks with less work run
an empty pass) because FSDP2's gathers are collective.

The LM head is applied through `rollflow.loss.token_logprobs`, so full logits never exist.
This module does not decide what to train on, and does not talk to the engine.
"""

from __future__ import annotations

import copy
import logging
import math
import time
from pathlib import Path
from typing import Any

import msgspec
import torch
import torch.distributed as dist
from torch import nn

from rollflow.config import LoRAConfig, LossConfig, TrainerConfig
from rollflow.loss import LossSpec, loss_divisor, policy_loss
from rollflow.records import TrainBatch, TrainSample
from rollflow.trainer.attention import use_segment_attention
from rollflow.trainer.batches import PolicyHead, lr_factor, pad, plan_micro_batches, plan_shards
from rollflow.trainer.export import full
from rollflow.trainer.heads import check_fused, choose_head
from rollflow.trainer.state import TrainerState

log = logging.getLogger(__name__)


class Trainer(TrainerState):
    """Model, optimizer and schedule of one rank, and the step that consumes a `TrainBatch`."""

    def __init__(
        self,
        model_path: str | Path,
        config: TrainerConfig = TrainerConfig(),  # noqa: B008 - frozen Struct
        loss: LossConfig = LossConfig(),  # noqa: B008 - frozen Struct
        *,
        device: str | torch.device | None = None,
    ) -> None:
        from transformers import AutoModelForCausalLM

        self.config = config
        self.loss_config = loss
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        if device is None:
            device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        dtype = torch.bfloat16 if config.dtype == "bfloat16" else torch.float32
        lm = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
        lm.to(self.device)  # type: ignore[arg-type]
        if config.gradient_checkpointing:
            lm.gradient_checkpointing_enable()
        if config.layout != "padded" or config.autocast != "none":
            use_segment_attention(lm)  # (which also evens the dtypes autocast leaves SDPA)
        self.head, _ = choose_head(config.fused_loss, self.device)
        """The log-prob head: `fused` (liger-kernel) or `chunked`."""
        if self.head == "fused" and (problem := check_fused(lm.get_output_embeddings().weight)) is not None:
            log.warning("loss head: chunked after all: liger-kernel's fused kernel failed its check (%s)", problem)
            self.head = "chunked"
        self.spec = loss_spec(loss)
        autocast = torch.bfloat16 if config.autocast == "bfloat16" else None
        self.reference: PolicyHead | None = None
        if loss.kl_coef > 0 and not config.lora.enabled:
            ref = copy.deepcopy(lm).eval().requires_grad_(False)
            self.reference = self._shard(PolicyHead(ref, config.loss_chunk, self.head, autocast, config.autocast_head))
        torch.manual_seed(config.seed)  # identical adapter initialisation on every rank
        if config.lora.enabled:
            lm = with_lora(lm, config.lora)  # type: ignore[assignment]
        self.module = self._shard(PolicyHead(lm, config.loss_chunk, self.head, autocast, config.autocast_head))
        params = [p for p in self.module.parameters() if p.requires_grad]
        # One fused kernel over every tensor (on a CPU too: SmolLM2's update 64 ms instead of 436 ms
        # on one core); FSDP2's sharded tensors keep the loop over tensors.
        kernel = {"foreach": False} if self.distributed else {"fused": True}
        self.optimizer = torch.optim.AdamW(
            params, lr=config.lr, betas=config.betas, weight_decay=config.weight_decay, **kernel
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_factor(config))
        self.steps = 0
        self.micro_batches: list[tuple[float, float, int, int]] = []
        """(start, end, samples, tokens) of each micro-batch of the last step (monotonic seconds)."""

    def _shard(self, module: PolicyHead) -> PolicyHead:
        """FSDP2 over ranks: each decoder layer is its own unit, the rest belongs to the root.
        Whenever a process group is up, a group of one rank included (the GPU check runs FSDP2
        over NCCL on one device that way)."""
        if not self.distributed:
            return module
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(self.device.type, (self.world_size,))
        for layer in module.lm.get_decoder().layers:  # type: ignore[operator, union-attr]
            fully_shard(layer, mesh=mesh)
        fully_shard(module, mesh=mesh)
        return module

    # ---- the step -------------------------------------------------------------------------

    def _logprobs(self, module: PolicyHead, t: dict[str, Any], sampling: tuple[float, int, float]):
        flat, entropy = module(t["ids"], t["attn"], t["positions"], t["segments"], t["gather"], t["targets"], *sampling)
        B, T = t["shape"]
        dense = torch.zeros(B * T, dtype=flat.dtype, device=flat.device).index_put((t["slots"],), flat)
        ent = torch.zeros(B * T, device=flat.device).index_put((t["slots"],), entropy)
        return dense.view(B, T), ent.view(B, T)

    def _empty_pass(self) -> None:
        """A forward/backward with zero loss, so FSDP2's collectives line up across ranks."""
        ids = torch.zeros(1, 2, dtype=torch.long, device=self.device)
        out, _ = self.module(
            ids,
            torch.ones_like(ids),
            None,
            None if self.config.layout == "padded" else [(0, 2, 0, 0)],
            torch.zeros(1, dtype=torch.long, device=self.device),
            torch.zeros(1, dtype=torch.long, device=self.device),
            1.0,
            0,
            1.0,
        )
        (out.sum() * 0.0).backward()

    def step(self, batch: TrainBatch) -> dict[str, float]:
        """One training step on the whole batch: `trainer.epochs` passes of `trainer.mini_batches`
        optimizer updates (one update by default); returns metrics (identical on every rank).

        A non-finite loss or gradient skips its update; `skipped` is 1 when every update was
        skipped (the weights did not change), and only then does the scheduler not tick."""
        cfg = self.config
        updates = [batch]
        if cfg.mini_batches * cfg.epochs > 1:
            old = self.score(batch.samples)  # the reference of every update's PPO ratio
            samples = [msgspec.structs.replace(s, old_logprobs=lp) for s, lp in zip(batch.samples, old, strict=True)]
            n, parts = len(samples), min(cfg.mini_batches, len(samples))
            chunks = [samples[n * k // parts : n * (k + 1) // parts] for k in range(parts)]
            updates = [msgspec.structs.replace(batch, samples=c) for _ in range(cfg.epochs) for c in chunks]
        results = [self._update(u) for u in updates]
        applied = [r for r in results if not r[1]]
        if applied:
            self.scheduler.step()
            self.steps += 1
        lr = float(self.scheduler.get_last_lr()[0])
        return _combine(results, epochs=cfg.epochs if len(updates) > 1 else 1, skipped=not applied, lr=lr)

    def _update(self, batch: TrainBatch) -> tuple[torch.Tensor, bool, float, torch.Tensor, torch.Tensor]:
        """One optimizer update on `batch`: (metric sums, skipped, grad norm, min and max ratio)."""
        sums, low, high = self.accumulate(batch)
        grad_norm = self._clip()
        if self.distributed:
            sums, low, high = self._reduced(sums, low, high)
        # A non-finite loss or gradient changes nothing. The norm and the loss are global, so
        # every rank takes the same branch.
        skipped = not math.isfinite(grad_norm) or not math.isfinite(float(sums[0]))
        if skipped:
            log.warning("step %d: non-finite loss or gradient (grad norm %s); update skipped", batch.step, grad_norm)
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return sums, skipped, grad_norm, low, high

    def _reduced(
        self, sums: torch.Tensor, low: torch.Tensor, high: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every rank's metric sums added and ratio bounds taken, on the device the process
        group's backend serves (NCCL holds no CPU tensors; gloo does), then back on the CPU."""
        sums, low, high = (t.to(self.device) for t in (sums, low, high))
        dist.all_reduce(sums)
        dist.all_reduce(low, op=dist.ReduceOp.MIN)
        dist.all_reduce(high, op=dist.ReduceOp.MAX)
        return sums.cpu(), low.cpu(), high.cpu()

    def accumulate(self, batch: TrainBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Forward and backward over this rank's share of the batch, adding into `.grad`.

        Returns this rank's metric sums and the min / max importance ratio (not yet reduced).
        """
        samples = batch.samples
        if not samples:
            raise ValueError(f"step {batch.step}: empty batch")
        settings = {(s.temperature, s.top_k, s.top_p) for s in samples}
        if len(settings) != 1:
            raise ValueError(f"step {batch.step}: samples use different sampling settings {sorted(settings)}")
        sampling = settings.pop()
        if sampling[0] <= 0:
            raise ValueError("greedy samples (temperature 0) have no distribution to train on")
        total_tokens = float(sum(sum(s.loss_mask) for s in samples))
        divisor = loss_divisor(self.spec.normalization, total_tokens, len(samples), batch.max_tokens)
        shards = plan_shards(samples, self.world_size, self.config.layout)
        plans = [plan_micro_batches(samples, s, self.config.micro_batch_tokens, self.config.layout) for s in shards]
        shard, mine = shards[self.rank], plans[self.rank]
        passes = max(len(p) for p in plans)
        assert sum(len(m) for m in mine) == len(shard)

        self.module.train()
        # loss, tokens, ratio, clip, IS-masked, mismatch KL, entropy, ref KL, outside support
        sums = torch.zeros(9, dtype=torch.float64)
        low, high = torch.tensor([math.inf], dtype=torch.float64), torch.tensor([-math.inf], dtype=torch.float64)
        self.micro_batches = []
        for i in range(passes):
            if i >= len(mine):
                self._empty_pass()
                continue
            began = time.monotonic()
            micro = [samples[j] for j in mine[i]]
            t = pad(micro, self.device, self.config.layout)
            logprobs, entropy = self._logprobs(self.module, t, sampling)
            logprobs, old, outside = _in_support(t, logprobs)
            ref = self._reference_logprobs(t, sampling) if self.spec.kl_coef > 0 else None
            loss, m = policy_loss(
                logprobs, t["behaviour"], t["token_adv"], t["mask"], self.spec,
                proximal_logprobs=old, ref_logprobs=ref, divisor=divisor,
            )  # fmt: skip
            # FSDP2 averages gradients over ranks; the loss is already normalised by the whole
            # batch, so scale back up to get the sum.
            (loss * self.world_size).backward()
            n = float(t["mask"].sum())
            sums += torch.tensor(
                [
                    loss.item(),
                    n,
                    m["ratio_mean"].item() * n,
                    m["clip_frac"].item() * n,
                    m["is_masked_frac"].item() * n,
                    m["mismatch_kl"].item() * n,
                    float((entropy * t["mask"]).sum()),
                    m["kl_ref"].item() * n,
                    outside,
                ],
                dtype=torch.float64,
            )
            if n:
                low[0] = min(low.item(), m["ratio_min"].item())
                high[0] = max(high.item(), m["ratio_max"].item())
            self.micro_batches.append((began, time.monotonic(), len(micro), int(n)))
        return sums, low, high

    @torch.no_grad()
    def _reference_logprobs(self, t: dict[str, Any], sampling: tuple[float, int, float]) -> torch.Tensor:
        """The reference policy's log-probs of the micro-batch `t` (for the KL penalty)."""
        if self.reference is not None:
            return self._logprobs(self.reference, t, sampling)[0]
        with self.lm.disable_adapter():  # type: ignore[operator]  # LoRA: the base model, adapters off
            return self._logprobs(self.module, t, sampling)[0]

    @torch.no_grad()
    def score(self, samples: list[TrainSample]) -> list[list[float]]:
        """Log-probs of each sample's completion tokens under the current policy (no update).

        Collective under FSDP2: every rank must call it with the same samples.
        """
        by_setting: dict[tuple[float, int, float], list[int]] = {}
        for i, s in enumerate(samples):
            by_setting.setdefault((s.temperature, s.top_k, s.top_p), []).append(i)
        out: list[list[float]] = [[] for _ in samples]
        self.module.eval()
        for sampling, indices in sorted(by_setting.items()):
            for micro in plan_micro_batches(samples, indices, self.config.micro_batch_tokens, self.config.layout):
                t = pad([samples[i] for i in micro], self.device, self.config.layout)
                logprobs, _ = self._logprobs(self.module, t, sampling)
                for b, i in enumerate(micro):
                    out[i] = logprobs[b, : samples[i].num_completion].tolist()
        return out

    def gradients(self) -> dict[str, torch.Tensor]:
        """Current gradients, whole, by parameter name (collective under FSDP2)."""
        return {name: full(p.grad) for name, p in self.module.named_parameters() if p.grad is not None}

    def _clip(self) -> float:
        params = [p for p in self.module.parameters() if p.grad is not None]
        max_norm = self.config.grad_clip if self.config.grad_clip > 0 else math.inf
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        return float(full(norm))


def _combine(updates: list[tuple], *, epochs: int, skipped: bool, lr: float) -> dict[str, float]:
    """A step's metrics from its updates' (sums, skipped, grad norm, low, high): loss and grad
    norm are means over the updates, the per-token ones means over every update's tokens, the
    token counts those of one pass over the batch."""
    total = sum((u[0] for u in updates), torch.zeros(9, dtype=torch.float64))
    n = max(total[1].item(), 1.0)
    lows = [u[3].item() for u in updates if u[0][1]]
    highs = [u[4].item() for u in updates if u[0][1]]
    norms = [u[2] for u in updates]
    return {
        "loss": sum(u[0][0].item() for u in updates) / len(updates),
        "tokens": total[1].item() / epochs,
        "ratio_mean": total[2].item() / n,
        "ratio_min": min(lows) if lows else 1.0,
        "ratio_max": max(highs) if highs else 1.0,
        "clip_frac": total[3].item() / n,
        "is_masked_frac": total[4].item() / n,
        "mismatch_kl": total[5].item() / n,
        "entropy": total[6].item() / n,
        "kl_ref": total[7].item() / n,
        "outside_support_tokens": total[8].item() / epochs,
        "grad_norm": sum(norms) / len(norms),
        "lr": lr,
        "skipped": float(skipped),
    }


def with_lora(lm: nn.Module, config: LoRAConfig) -> nn.Module:
    """`lm` wrapped by peft with fresh LoRA adapters (initialised from torch's current seed)."""
    from peft import LoraConfig, get_peft_model

    return get_peft_model(  # type: ignore[return-value]
        lm,  # type: ignore[arg-type]
        LoraConfig(
            r=config.rank,
            lora_alpha=config.alpha,
            lora_dropout=config.dropout,
            target_modules=list(config.target_modules),
        ),
    )


def loss_spec(config: LossConfig) -> LossSpec:
    """The loss settings of `config` (`LossSpec`'s fields are `LossConfig`'s of the same names)."""
    return LossSpec(**{name: getattr(config, name) for name in LossSpec.__struct_fields__})


def _in_support(t: dict[str, Any], logprobs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, float]:
    """(log-probs, pre-step log-probs, tokens left out): a token outside the trainer's top-k /
    top-p support (near-ties off-policy) has log-prob -inf, so it leaves the loss (`t["mask"]`
    is cut) and is counted, instead of turning the loss into NaN. Environment tokens (mask 0)
    were never sampled and are often outside it too."""
    finite = torch.isfinite(logprobs)
    old = t["old"]
    if old is not None:  # outside the support before this step's first update
        finite &= torch.isfinite(old)
        old = torch.where(torch.isfinite(old), old, torch.zeros_like(old))
    outside = float((t["mask"] * ~finite).sum())
    if not bool(finite.all()):
        t["mask"] = t["mask"] * finite
        logprobs = torch.where(finite, logprobs, torch.zeros_like(logprobs))
    return logprobs, old, outside
