"""Policy losses as pure tensor functions; log-probs of sampled tokens without full logits.

Two parts:

1. `token_logprobs` (in `rollflow.logprobs`, named here too): log-prob of each target token under
   the distribution the engine sampled from, from final hidden states and the LM head in chunks.

2. `policy_loss`: the clipped policy-gradient objectives of the GRPO family as formulas, one
   surrogate per objective (`ppo_clip` per token, `gspo` per sequence, `cispo`'s clipped
   weights), an importance-sampling correction against the behaviour log-probs recorded by the
   engine (`importance_weights`), one normalisation (`normalize`, over the whole batch's
   `loss_divisor`), an optional KL to a reference (`kl_term`), per-token loss masks, and
   metrics (`loss_metrics`); the settings are one `LossSpec`.

No IO, no config objects, no distributed code: callers pass tensors and numbers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import msgspec
import torch

from rollflow.logprobs import DEFAULT_CHUNK as DEFAULT_CHUNK  # named here too, where callers look
from rollflow.logprobs import naive_token_logprobs as naive_token_logprobs
from rollflow.logprobs import support_mask as support_mask
from rollflow.logprobs import token_logprobs as token_logprobs

Normalization = Literal["grpo", "dr_grpo", "token_mean"]
Objective = Literal["ppo_clip", "gspo", "cispo"]
KLEstimator = Literal["k1", "k2", "k3"]
ISMode = Literal["none", "tis", "mis", "seq_tis", "seq_mis"]


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


class LossSpec(msgspec.Struct, frozen=True, kw_only=True):
    """The policy loss's settings (`LossConfig`'s fields of the same names): which surrogate,
    its clip range, the importance-sampling correction, the normalisation and the KL term."""

    objective: Objective = "ppo_clip"
    eps_low: float = 0.2
    eps_high: float = 0.28
    normalization: Normalization = "token_mean"
    is_mode: ISMode = "tis"
    is_cap: float = 2.0
    is_low: float = 0.5
    is_high: float = 2.0
    kl_coef: float = 0.0
    kl_estimator: KLEstimator = "k3"


Surrogate = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, LossSpec], tuple[torch.Tensor, torch.Tensor]
]
"""(logprobs, proximal logprobs, advantages, mask, spec) -> (surrogate per token, ratio), all (B, T)."""


def ppo_clip(
    logprobs: torch.Tensor, proximal: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, spec: LossSpec
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO / GRPO: min(r·A, clip(r, 1-eps_low, 1+eps_high)·A) per token, r = π / π_prox."""
    ratio = torch.exp(logprobs - proximal)  # (B, T)
    return torch.minimum(ratio * adv, ratio.clamp(1.0 - spec.eps_low, 1.0 + spec.eps_high) * adv), ratio


def gspo(
    logprobs: torch.Tensor, proximal: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, spec: LossSpec
) -> tuple[torch.Tensor, torch.Tensor]:
    """GSPO: the PPO clip with one ratio per sequence, s = exp(mean over its tokens of log r),
    clipped per sequence and spread over the sequence's tokens."""
    seq_log_ratio = _masked_mean((logprobs - proximal) * mask, mask, dim=-1)  # (B,)
    ratio = seq_log_ratio.exp()[:, None].expand_as(logprobs)  # (B, T), with grad
    return torch.minimum(ratio * adv, ratio.clamp(1.0 - spec.eps_low, 1.0 + spec.eps_high) * adv), ratio


def cispo(
    logprobs: torch.Tensor, proximal: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, spec: LossSpec
) -> tuple[torch.Tensor, torch.Tensor]:
    """CISPO: sg(clip(r, 1-eps_low, 1+eps_high)) · A · log π: the clipped ratio is a detached
    weight, so no token leaves the gradient."""
    ratio = torch.exp(logprobs - proximal)  # (B, T)
    return ratio.clamp(1.0 - spec.eps_low, 1.0 + spec.eps_high).detach() * adv * logprobs, ratio


SURROGATES: dict[str, Surrogate] = {"ppo_clip": ppo_clip, "gspo": gspo, "cispo": cispo}
"""Each objective's surrogate (what the loss maximises per token, before weights and normalising)."""


def loss_divisor(normalization: Normalization, tokens: float, sequences: int, max_tokens: int) -> float:
    """What a whole batch's summed loss is divided by (every micro-batch and rank uses the
    batch's, so the step does not depend on how the batch is split): its loss tokens
    (`token_mean`), its sequences (`grpo`, after each sequence's own token mean), or sequences ×
    `max_tokens` (`dr_grpo`)."""
    return {
        "token_mean": max(tokens, 1.0),
        "grpo": float(sequences),
        "dr_grpo": float(sequences * max_tokens),
    }[normalization]


def normalize(per_token: torch.Tensor, kept: torch.Tensor, mask: torch.Tensor, spec: LossSpec, divisor: float | None):
    """The loss from per-token terms (B, T): the kept tokens summed (per sequence's token mean
    first for `grpo`), over `divisor` (default: this batch's own, as `loss_divisor` counts it)."""
    if spec.normalization == "token_mean":
        return (per_token * kept).sum() / (divisor if divisor is not None else mask.sum().clamp(min=1))
    if spec.normalization == "grpo":
        per_seq = (per_token * kept).sum(-1) / mask.sum(-1).clamp(min=1)  # (B,)
        return per_seq.sum() / (divisor if divisor is not None else per_seq.shape[0])
    if spec.normalization == "dr_grpo":
        if divisor is None:
            raise ValueError("dr_grpo needs the batch's divisor (sequences × max_tokens)")
        return (per_token * kept).sum() / divisor
    raise ValueError(f"unknown normalization {spec.normalization!r}")


def kl_term(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor, estimator: KLEstimator):
    """(per-token KL estimate to the reference, the mask of tokens it is defined on), (B, T).

    Only loss tokens the reference gives a finite log-prob (under top-k / top-p it can be -inf)
    reach the arithmetic: elsewhere delta is 0, so neither the value nor the gradient meets an
    inf (inf × 0 would be NaN)."""
    kl_mask = mask * torch.isfinite(ref_logprobs)
    defined = kl_mask.bool()
    delta = torch.where(defined, ref_logprobs, logprobs.detach()) - logprobs  # (B, T)
    delta = torch.where(defined, delta, torch.zeros_like(delta))
    return kl_estimate(delta, estimator), kl_mask


def policy_loss(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    spec: LossSpec = LossSpec(),  # noqa: B008 - frozen Struct
    *,
    proximal_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    divisor: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The clipped policy-gradient loss of `spec.objective` with importance-sampling correction.

    All (B, T): logprobs (current policy, with grad), behaviour_logprobs (from the engine),
    advantages (per token), mask (1 for tokens in the loss). proximal_logprobs: the policy
    before this step; defaults to `logprobs.detach()` (one optimizer step per batch), which makes
    the ratio 1 with the gradient of log π. The loss per token is -w · surrogate + kl_coef · KL,
    w the importance weight π_prox / μ; `normalize` turns it into one number, over `divisor`
    (`loss_divisor` of the whole batch; default: this batch's own). Tokens dropped by importance
    sampling lower the loss without re-weighting the rest."""
    mask = mask.to(logprobs.dtype)
    proximal = logprobs.detach() if proximal_logprobs is None else proximal_logprobs
    weights, kept = importance_weights(
        proximal, behaviour_logprobs, mask, mode=spec.is_mode, cap=spec.is_cap, low=spec.is_low, high=spec.is_high
    )
    if spec.objective not in SURROGATES:
        raise ValueError(f"unknown objective {spec.objective!r}")
    surrogate, ratio = SURROGATES[spec.objective](logprobs, proximal, advantages, mask, spec)
    per_token = -weights.detach() * surrogate  # (B, T)
    kl, kl_mask = torch.zeros_like(per_token), mask
    if ref_logprobs is not None and spec.kl_coef != 0.0:
        kl, kl_mask = kl_term(logprobs, ref_logprobs, mask, spec.kl_estimator)
        per_token = per_token + spec.kl_coef * kl
    loss = normalize(per_token, kept, mask, spec, divisor)
    return loss, loss_metrics(spec, ratio, advantages, proximal, behaviour_logprobs, mask, kept, kl, kl_mask)


@torch.no_grad()
def loss_metrics(
    spec: LossSpec,
    ratio: torch.Tensor,
    adv: torch.Tensor,
    proximal: torch.Tensor,
    behaviour: torch.Tensor,
    mask: torch.Tensor,
    kept: torch.Tensor,
    kl: torch.Tensor,
    kl_mask: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """What a step logs of its loss: the importance ratios' spread, the clipped fraction, the
    share masked by importance sampling, the behaviour/trainer mismatch and the KL to the reference."""
    valid = mask.bool()
    any_valid = bool(valid.any())
    values = (proximal - behaviour).exp()[valid] if any_valid else torch.ones(1)
    log_ratio = (proximal - behaviour)[valid] if any_valid else torch.zeros(1)
    low, high = 1.0 - spec.eps_low, 1.0 + spec.eps_high
    if spec.objective == "cispo":  # every clipped weight counts: no token is dropped either way
        clip_hit = (ratio < low) | (ratio > high)
    else:
        clip_hit = ((ratio < low) & (adv < 0)) | ((ratio > high) & (adv > 0))
    return {
        "ratio_mean": values.mean(),
        "ratio_min": values.min(),
        "ratio_max": values.max(),
        "clip_frac": _masked_mean(clip_hit.to(mask.dtype), mask),
        "is_masked_frac": 1.0 - kept.sum() / mask.sum().clamp(min=1),
        # KL(μ || π) by the k3 estimator over the behaviour samples: r - 1 - log r, r = π/μ.
        "mismatch_kl": (log_ratio.exp() - 1.0 - log_ratio).mean(),
        "kl_ref": _masked_mean(kl, kl_mask),
    }
