"""The log-prob head: per-token log-probs of the sampled tokens from final hidden states.

Two implementations behind one call, chosen once per trainer (`choose_head`): the chunked torch
head (`rollflow.loss.token_logprobs`: full logits never exist, any device, any sampling
settings, entropy measured) and, on CUDA with liger-kernel installed and `trainer.fused_loss`
on, liger-kernel's fused linear + cross-entropy kernel, which computes the same log-probs
without materialising logits either, in one Triton kernel. The fused kernel knows no top-k /
top-p truncation and measures no entropy: a micro-batch sampled with truncation goes through
the chunked head, and the fused one reports entropy 0. Before a trainer uses the fused kernel,
`check_fused` compares it with the chunked head on the model's own LM head (the log-probs, and the
gradient of a per-token weighted sum, as a policy loss weighs tokens): a kernel whose backward
takes the per-token weights as one scale would train on wrong gradients, so a mismatch keeps the
chunked head, with a warning. One log line at start says which head a trainer uses and why. This
module holds no model; `rollflow.trainer.batches.PolicyHead` calls it.
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
    backward_dtype: torch.dtype | None = None,
    forward_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs (N,), entropy (N,)) of `targets` under the sampling distribution, through
    `head`; truncated sampling (top-k / top-p) always takes the chunked head. `backward_dtype`,
    `forward_dtype`: the chunked head's products in that dtype (`rollflow.loss.token_logprobs`)."""
    if head == "fused" and top_k <= 0 and top_p >= 1.0:
        logprobs = fused_logprobs(hidden, weight, targets, temperature)
        return logprobs, torch.zeros_like(logprobs)
    return token_logprobs(
        hidden, weight, targets, temperature=temperature, top_k=top_k, top_p=top_p, chunk=chunk,
        backward_dtype=backward_dtype, forward_dtype=forward_dtype,
    )  # fmt: skip


CHECK_TOKENS = 256
"""Tokens of the fused kernel's check against the chunked head."""

CHECK_TOLERANCE = 2e-2
"""Largest difference allowed, relative to the chunked head's scale (bf16 kernels differ in
their last bits; a wrong per-token gradient differs by its whole size)."""


def check_fused(weight: torch.Tensor, temperature: float = 1.0) -> str | None:
    """Why the fused kernel must not train with the LM head `weight` (V, H), or None: its
    log-probs and the gradient of a per-token weighted sum of them (random weights of both
    signs, as a policy loss's) against the chunked head's, relative to their scale."""
    generator = torch.Generator(device=weight.device).manual_seed(0)
    head = weight.detach()
    hidden = torch.randn(CHECK_TOKENS, head.shape[1], device=head.device, generator=generator, dtype=head.dtype)
    targets = torch.randint(0, head.shape[0], (CHECK_TOKENS,), device=head.device, generator=generator)
    scale = torch.randn(CHECK_TOKENS, device=head.device, generator=generator)
    results = []
    for fused in (True, False):
        h = hidden.clone().requires_grad_(True)
        if fused:
            logprobs = fused_logprobs(h, head, targets, temperature)
        else:
            logprobs, _ = token_logprobs(h, head, targets, temperature=temperature)
        (logprobs.float() * scale).sum().backward()
        assert h.grad is not None
        results.append((logprobs.detach().float(), h.grad.float()))
    (fused_lp, fused_grad), (lp, grad) = results
    for name, got, want in (("log-probs", fused_lp, lp), ("per-token gradient", fused_grad, grad)):
        error = float((got - want).abs().max() / want.abs().max().clamp_min(1e-12))
        if not error <= CHECK_TOLERANCE:
            return f"{name} off the chunked head's by {error:.3g} of their scale"
    return None
