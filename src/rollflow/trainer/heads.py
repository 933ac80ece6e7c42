"""The log-prob head: per-token log-probs of the sampled tokens from final hidden states.

Two implementations behind one call, chosen once per trainer (`choose_head`): the chunked torch
head (`rollflow.loss.token_logprobs`: full logits never exist, any device, any sampling
settings, entropy measured) and, on CUDA with liger-kernel installed and `trainer.fused_loss`
on, liger-kernel's fused linear + cross-entropy kernel, which computes the same log-probs
without materialising logits either, in one Triton kernel. The fused kernel knows no top-k /
top-p truncation and measures no entropy: a micro-batch sampled with truncation goes through
the chunked head, and the fused one reports entropy 0. One log line at start says which head a
trainer uses and why. This module holds no model; `rollflow.trainer.batches.PolicyHead` calls it.
"""

from __future__ import annotations

import importlib.util
import logging

import torch

from rollflow.loss import token_logprobs

log = logging.getLogger(__name__)

Head = str
"""`fused` (liger-kernel) or `chunked` (rollflow.loss)."""


def choose_head(fused_loss: bool, device: torch.device) -> tuple[Head, str]:
    """(the head a trainer on `device` uses, why), and the reason logged once."""
    if not fused_loss:
        head, why = "chunked", "trainer.fused_loss is off"
    elif device.type != "cuda":
        head, why = "chunked", f"liger-kernel's fused kernel needs CUDA (the trainer is on {device.type})"
    elif importlib.util.find_spec("liger_kernel") is None:
        head, why = "chunked", "liger-kernel is not installed (pip install 'rollflow[gpu]')"
    else:
        head, why = "fused", "liger-kernel's fused linear + cross-entropy on CUDA"
    log.info("loss head: %s (%s)", head, why)
    return head, why


def fused_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float
) -> torch.Tensor:
    """log p(target) per token through liger-kernel's fused linear cross-entropy (no top-k /
    top-p): hidden (N, H), weight (V, H), targets (N,) -> (N,) float32."""
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    loss = LigerFusedLinearCrossEntropyLoss(reduction="none")
    scaled = hidden / temperature if temperature != 1.0 else hidden
    return -loss(weight, scaled, targets).float()


def head_logprobs(
    head: Head,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float,
    top_k: int,
    top_p: float,
    chunk: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs (N,), entropy (N,)) of `targets` under the sampling distribution, through
    `head`; truncated sampling (top-k / top-p) always takes the chunked head."""
    if head == "fused" and top_k <= 0 and top_p >= 1.0:
        logprobs = fused_logprobs(hidden, weight, targets, temperature)
        return logprobs, torch.zeros_like(logprobs)
    return token_logprobs(hidden, weight, targets, temperature=temperature, top_k=top_k, top_p=top_p, chunk=chunk)
