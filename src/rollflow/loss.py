"""Policy losses as pure tensor functions; log-probs of sampled tokens without full logits.

Two parts:

1. `token_logprobs`: log-prob of each target token under the distribution the engine sampled
   from (logits / temperature, renormalised over the top-k / top-p support when those were used),
   computed from final hidden states and the LM head in chunks of tokens. The (tokens × vocab)
   logits tensor never exists whole: a custom autograd function keeps only the inputs and
   recomputes one chunk's logits in backward. The same path runs on CUDA; liger-kernel's fused
   kernel is not wired in (it needs a GPU to build and check against this path).

2. `policy_loss`: the clipped policy-gradient objectives of the GRPO family (PPO-clip per
   token, GSPO per sequence, CISPO's clipped weights) with an importance-sampling correction
   against the behaviour log-probs recorded by the engine, a choice of normalisation, an
   optional k3 KL to a reference, per-token loss masks, and metrics.

No IO, no config objects, no distributed code: callers pass tensors and numbers.
"""

from __future__ import annotations

from typing import Literal

import torch

Normalization = Literal["grpo", "dr_grpo", "token_mean"]
Objective = Literal["ppo_clip", "gspo", "cispo"]
KLEstimator = Literal["k1", "k2", "k3"]
ISMode = Literal["none", "tis", "mis", "seq_tis", "seq_mis"]

DEFAULT_CHUNK = 128
"""Tokens per chunk of LM-head logits: 128 × 49,152 float32 logits are 25 MB."""


def support_mask(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor | None:
    """Boolean mask of the tokens that survive top-k then top-p, as vLLM's sampler applies them.

    `logits` are already divided by the temperature. Returns None when nothing is truncated.
    """
    if top_k <= 0 and top_p >= 1.0:
        return None
    keep = torch.ones_like(logits, dtype=torch.bool)  # (N, V)
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (N, 1)
        keep &= logits >= kth
    if top_p < 1.0:
        masked = logits.masked_fill(~keep, float("-inf"))
        sorted_logits, order = torch.sort(masked, dim=-1, descending=False)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)  # ascending
        # Drop the low tail whose mass is at most 1 - p; always keep the most likely token.
        drop_sorted = cumulative <= (1.0 - top_p)
        drop_sorted[:, -1] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        keep &= ~drop
    return keep


def _chunk_logits(
    hidden: torch.Tensor, weight: torch.Tensor, temperature: float, top_k: int, top_p: float
) -> torch.Tensor:
    """Sampling-distribution logits of one chunk, (c, V) float32; truncated entries are -inf.

    Works in place on the one (c, V) buffer it allocates.
    """
    logits = (hidden @ weight.t()).float()  # (c, V)
    if temperature != 1.0:
        logits.div_(temperature)
    keep = support_mask(logits, top_k, top_p)
    if keep is not None:
        logits.masked_fill_(~keep, float("-inf"))
    return logits


def _softmax_(logits: torch.Tensor, top: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax in place over the last dim, normalised by its own sum (as accurate as
    `torch.softmax`); returns (probabilities, sum of exp(logits - top))."""
    probs = logits.sub_(top).exp_()
    total = probs.sum(dim=-1, keepdim=True)  # (c, 1)
    return probs.div_(total), total


class _ChunkedLogprobs(torch.autograd.Function):
    """log p(target) per token, chunk by chunk; backward recomputes each chunk's logits.

    Peak extra memory is a few (chunk × vocab) buffers plus the LM-head gradient, instead of
    several (tokens × vocab) tensors.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, top_k, top_p, chunk):  # type: ignore[override]
        out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)  # (N,)
        entropy = torch.empty_like(out)
        for start in range(0, hidden.shape[0], chunk):
            end = min(start + chunk, hidden.shape[0])
            logits = _chunk_logits(hidden[start:end], weight, temperature, top_k, top_p)  # (c, V)
            top = logits.amax(dim=-1, keepdim=True)  # (c, 1)
            target = logits.gather(-1, targets[start:end, None]) - top  # (c, 1)
            probs, total = _softmax_(logits, top)
            out[start:end] = (target - total.log()).squeeze(-1)
            entropy[start:end] = torch.special.entr(probs).sum(-1)
            del logits, probs  # free this chunk before the next one is allocated
        ctx.save_for_backward(hidden, weight, targets)
        ctx.settings = (temperature, top_k, top_p, chunk)
        ctx.mark_non_differentiable(entropy)
        return out, entropy

    @staticmethod
    def backward(ctx, grad_out, _grad_entropy):  # type: ignore[override]
        hidden, weight, targets = ctx.saved_tensors
        temperature, top_k, top_p, chunk = ctx.settings
        grad_hidden = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        for start in range(0, hidden.shape[0], chunk):
            end = min(start + chunk, hidden.shape[0])
            logits = _chunk_logits(hidden[start:end], weight, temperature, top_k, top_p)  # (c, V)
            # d log p(y) / d logits = onehot(y) - softmax, times the upstream grad and 1/T; built
            # in place in the logits buffer.
            grad_logits, _ = _softmax_(logits, logits.amax(dim=-1, keepdim=True))
            grad_logits.neg_()
            grad_logits.scatter_add_(-1, targets[start:end, None], torch.ones_like(grad_logits[:, :1]))
            grad_logits.mul_((grad_out[start:end] / temperature)[:, None])
            grad_logits = grad_logits.to(hidden.dtype)
            if grad_hidden is not None:
                grad_hidden[start:end] = grad_logits @ weight
            if grad_weight is not None:
                grad_weight.addmm_(grad_logits.t(), hidden[start:end])  # no (V, H) temporary
            del logits, grad_logits  # free this chunk before the next one is allocated
        return grad_hidden, grad_weight, None, None, None, None, None


def token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    chunk: int = DEFAULT_CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs of `targets` and (detached) entropies, without full logits.

    hidden: (N, H) final hidden states; weight: (V, H) LM head; targets: (N,) token ids.
    Returns (logprobs (N,), entropy (N,)) in float32 under the sampling distribution:
    softmax(logits / temperature) renormalised over the top-k / top-p support.
    """
    if temperature <= 0:
        raise ValueError("temperature must be > 0 to score tokens (greedy samples have no distribution)")
    return _ChunkedLogprobs.apply(hidden, weight, targets, float(temperature), int(top_k), float(top_p), int(chunk))


def naive_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
) -> torch.Tensor:
    """Reference: the same quantity through full logits (for tests and the memory benchmark)."""
    logits = (hidden @ weight.t()).float() / temperature  # (N, V)
    keep = support_mask(logits.detach(), top_k, top_p)
    if keep is not None:
        logits = logits.masked_fill(~keep, float("-inf"))
    return torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None]).squeeze(-1)


def _masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=1)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def kl_estimate(delta: torch.Tensor, estimator: KLEstimator = "k3") -> torch.Tensor:
    """Per-token estimate of KL(π || π_ref) from delta = log π_ref - log π at tokens sampled from π
    (Schulman's estimators): k1 = -delta (unbiased, can be negative), k2 = delta² / 2 (biased,
    >= 0), k3 = exp(delta) - delta - 1 (unbiased, >= 0)."""
    if estimator == "k1":
        return -delta
    if estimator == "k2":
        return 0.5 * delta * delta
    if estimator == "k3":
        return delta.exp() - delta - 1.0
    raise ValueError(f"unknown KL estimator {estimator!r}")


def importance_weights(
    proximal_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    mode: ISMode = "tis",
    cap: float = 2.0,
    low: float = 0.5,
    high: float = 2.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Importance weights π_trainer / μ_behaviour per token, and the mask of tokens kept.

    All inputs (B, T); `proximal_logprobs` is detached. Modes:
    - `tis`: token-level, truncated at `cap`.
    - `mis`: token-level, tokens with a ratio outside [low, high] are dropped (IcePop-style).
    - `seq_tis` / `seq_mis`: one weight per sequence from the **mean** token log-ratio (a sum
      would explode with length), truncated at `cap` or the sequence dropped outside [low, high].
    - `none`: weight 1.
    """
    log_ratio = (proximal_logprobs - behaviour_logprobs) * mask  # (B, T)
    kept = mask.clone()
    if mode == "none":
        return torch.ones_like(log_ratio), kept
    if mode in ("tis", "mis"):
        ratio = log_ratio.exp()
        if mode == "tis":
            return ratio.clamp(max=cap), kept
        inside = (ratio >= low) & (ratio <= high)
        return ratio, kept * inside
    seq_log_ratio = _masked_mean(log_ratio, mask, dim=-1)  # (B,)
    seq_ratio = seq_log_ratio.exp()[:, None].expand_as(log_ratio)  # (B, T)
    if mode == "seq_tis":
        return seq_ratio.clamp(max=cap), kept
    if mode == "seq_mis":
        inside = (seq_ratio >= low) & (seq_ratio <= high)
        return seq_ratio, kept * inside
    raise ValueError(f"unknown importance-sampling mode {mode!r}")


def policy_loss(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    proximal_logprobs: torch.Tensor | None = None,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    normalization: Normalization = "token_mean",
    denominator: float | None = None,
    is_mode: ISMode = "tis",
    is_cap: float = 2.0,
    is_low: float = 0.5,
    is_high: float = 2.0,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    token_advantages: torch.Tensor | None = None,
    objective: Objective = "ppo_clip",
    kl_estimator: KLEstimator = "k3",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped policy-gradient loss with importance-sampling correction.

    logprobs: (B, T) current policy, with grad. behaviour_logprobs: (B, T) from the engine.
    advantages: (B,) per sequence (or `token_advantages` (B, T) for per-token rewards).
    mask: (B, T) 1 for tokens in the loss (policy tokens within the staleness bound).
    proximal_logprobs: (B, T) the policy before this step; defaults to `logprobs.detach()`
    (one optimizer step per batch), which makes the PPO ratio 1 with the gradient of log π.

    The loss per token is -w · f(r, A) + kl_coef · KL estimate (`kl_estimator`), with r = π/π_prox, w the importance
    weight π_prox/μ, and f by `objective`:
    - `ppo_clip`: min(r·A, clip(r, 1-eps_low, 1+eps_high)·A) per token (PPO / GRPO);
    - `gspo`: the same with one ratio per sequence, s = exp(mean over its tokens of log r),
      clipped per sequence (GSPO), spread over the sequence's tokens;
    - `cispo`: sg(clip(r, 1-eps_low, 1+eps_high)) · A · log π: the clipped ratio is a detached
      weight, so no token leaves the gradient (CISPO).
    Normalisation:
    - `token_mean`: sum over tokens / number of tokens (DAPO);
    - `grpo`: mean over each sequence's tokens, then over sequences;
    - `dr_grpo`: sum over tokens / (sequences × `denominator`, a constant such as max_tokens).
    Divisors count the tokens of `mask`, so tokens dropped by importance sampling lower the loss
    without re-weighting the rest. `denominator` overrides the divisor of `token_mean` (token
    count) and `grpo` (sequence count), so that a micro-batch or one rank's shard can be
    normalised by the whole batch's count.
    """
    mask = mask.to(logprobs.dtype)
    if proximal_logprobs is None:
        proximal_logprobs = logprobs.detach()
    adv = token_advantages if token_advantages is not None else advantages[:, None].expand_as(logprobs)  # (B, T)
    weights, kept = importance_weights(
        proximal_logprobs, behaviour_logprobs, mask, mode=is_mode, cap=is_cap, low=is_low, high=is_high
    )
    ratio = torch.exp(logprobs - proximal_logprobs)  # (B, T)
    if objective == "gspo":  # one ratio per sequence: the geometric mean of its token ratios
        seq_log_ratio = _masked_mean((logprobs - proximal_logprobs) * mask, mask, dim=-1)  # (B,)
        ratio = seq_log_ratio.exp()[:, None].expand_as(logprobs)  # (B, T), with grad
    clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    if objective == "cispo":
        surrogate = clipped.detach() * adv * logprobs
    elif objective in ("ppo_clip", "gspo"):
        surrogate = torch.minimum(ratio * adv, clipped * adv)
    else:
        raise ValueError(f"unknown objective {objective!r}")
    per_token = -weights.detach() * surrogate  # (B, T)
    kl = torch.zeros_like(per_token)
    kl_mask = mask
    if ref_logprobs is not None and kl_coef != 0.0:
        # Only loss tokens the reference gives a finite log-prob (under top-k / top-p it can be
        # -inf) reach the arithmetic: elsewhere delta is 0, so neither the value nor the
        # gradient meets an inf (inf × 0 would be NaN).
        kl_mask = mask * torch.isfinite(ref_logprobs)
        defined = kl_mask.bool()
        delta = torch.where(defined, ref_logprobs, logprobs.detach()) - logprobs  # (B, T)
        delta = torch.where(defined, delta, torch.zeros_like(delta))
        kl = kl_estimate(delta, kl_estimator)
        per_token = per_token + kl_coef * kl
    if normalization == "token_mean":
        loss = (per_token * kept).sum() / (denominator if denominator is not None else mask.sum().clamp(min=1))
    elif normalization == "grpo":
        per_seq = (per_token * kept).sum(-1) / mask.sum(-1).clamp(min=1)  # (B,)
        loss = per_seq.sum() / (denominator if denominator is not None else per_seq.shape[0])
    elif normalization == "dr_grpo":
        if denominator is None:
            raise ValueError("dr_grpo needs a constant `denominator` (e.g. sequences × max_tokens)")
        loss = (per_token * kept).sum() / denominator
    else:
        raise ValueError(f"unknown normalization {normalization!r}")

    with torch.no_grad():
        is_ratio = (proximal_logprobs - behaviour_logprobs).exp()
        valid = mask.bool()
        values = is_ratio[valid] if valid.any() else torch.ones(1)
        log_ratio = (proximal_logprobs - behaviour_logprobs)[valid] if valid.any() else torch.zeros(1)
        if objective == "cispo":  # every clipped weight counts: no token is dropped either way
            clip_hit = (ratio < 1.0 - eps_low) | (ratio > 1.0 + eps_high)
        else:
            clip_hit = ((ratio < 1.0 - eps_low) & (adv < 0)) | ((ratio > 1.0 + eps_high) & (adv > 0))
        metrics = {
            "ratio_mean": values.mean(),
            "ratio_min": values.min(),
            "ratio_max": values.max(),
            "clip_frac": _masked_mean(clip_hit.to(mask.dtype), mask),
            "is_masked_frac": 1.0 - kept.sum() / mask.sum().clamp(min=1),
            # KL(μ || π) by the k3 estimator over the behaviour samples: r - 1 - log r, r = π/μ.
            "mismatch_kl": (log_ratio.exp() - 1.0 - log_ratio).mean(),
            "kl_ref": _masked_mean(kl, kl_mask),
        }
    return loss, metrics
