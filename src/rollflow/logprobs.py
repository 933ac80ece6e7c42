"""Log-probs of sampled tokens without full logits.

`token_logprobs`: log-prob of each target token under the distribution the engine sampled from
(logits / temperature, renormalised over the top-k / top-p support when those were used),
computed from final hidden states and the LM head in chunks of tokens. The (tokens × vocab)
logits tensor never exists whole: a custom autograd function keeps only the inputs and
recomputes one chunk's logits in backward. On CUDA with liger-kernel installed the trainer may
use its fused linear + cross-entropy kernel instead (`rollflow.trainer.heads`).
`naive_token_logprobs` is the same with full logits, the reference the tests compare against.
"""

from __future__ import annotations

import torch

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
    several (tokens × vocab) tensors. With a `backward_dtype` (bfloat16 under autocast) the
    backward's recomputed logits and the hidden states' gradient are products in that dtype; the
    forward, whose log-probs the importance ratio takes, stays in the weights' dtype.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, top_k, top_p, chunk, backward_dtype):  # type: ignore[override]
        out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)  # (N,)
        entropy = torch.empty_like(out)
        tops = torch.empty_like(out)
        for start in range(0, hidden.shape[0], chunk):
            end = min(start + chunk, hidden.shape[0])
            logits = _chunk_logits(hidden[start:end], weight, temperature, top_k, top_p)  # (c, V)
            top = logits.amax(dim=-1, keepdim=True)  # (c, 1)
            tops[start:end] = top.squeeze(-1)
            target = logits.gather(-1, targets[start:end, None]) - top  # (c, 1)
            shifted = logits.sub_(top)  # z = logits - top, in place
            exp = shifted.exp()
            total = exp.sum(dim=-1, keepdim=True)  # (c, 1)
            out[start:end] = (target - total.log()).squeeze(-1)
            # H = -sum p log p = log S - sum(e^z z) / S, with p = e^z / S (-inf z: e^z z = 0).
            weighted = torch.linalg.vecdot(exp, shifted.nan_to_num_(neginf=0.0))
            entropy[start:end] = total.squeeze(-1).log() - weighted / total.squeeze(-1)
            del logits, shifted, exp  # free this chunk before the next one is allocated
        ctx.save_for_backward(hidden, weight, targets, tops)
        ctx.settings = (temperature, top_k, top_p, chunk, backward_dtype)
        ctx.mark_non_differentiable(entropy)
        return out, entropy

    @staticmethod
    def backward(ctx, grad_out, _grad_entropy):  # type: ignore[override]
        hidden, weight, targets, tops = ctx.saved_tensors
        temperature, top_k, top_p, chunk, backward_dtype = ctx.settings
        grad_hidden = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        narrow = None
        if backward_dtype is not None and backward_dtype != weight.dtype and top_k <= 0 and top_p >= 1.0:
            narrow = _NarrowHead(weight, backward_dtype)
        for start in range(0, hidden.shape[0], chunk):
            end = min(start + chunk, hidden.shape[0])
            h = hidden[start:end]
            if narrow is not None:
                grad_logits = narrow.softmax(h, tops[start:end], temperature)
            else:
                logits = _chunk_logits(h, weight, temperature, top_k, top_p)  # (c, V)
                grad_logits, _ = _softmax_(logits, logits.amax(dim=-1, keepdim=True))
            # d log p(y) / d logits = onehot(y) - softmax, times the upstream grad and 1/T; built
            # in place in the softmax's buffer.
            grad_logits.neg_()
            grad_logits.scatter_add_(-1, targets[start:end, None], torch.ones_like(grad_logits[:, :1]))
            grad_logits.mul_((grad_out[start:end] / temperature)[:, None])
            if grad_hidden is not None:
                grad_hidden[start:end] = narrow.grad_hidden(grad_logits) if narrow else grad_logits.to(h.dtype) @ weight
            if grad_weight is not None:
                grad_weight.addmm_(grad_logits.to(h.dtype).t(), h)  # no (V, H) temporary
            del grad_logits  # free this chunk before the next one is allocated
        return grad_hidden, grad_weight, None, None, None, None, None, None


class _NarrowHead:
    """The backward's LM-head products in a narrow dtype (bfloat16), for one backward pass.

    The logits are recomputed already shifted by each token's largest logit (saved by the
    forward): the weight matrix gains a column of ones and the hidden states one of -top, so the
    product, accumulated in float32 inside the kernel, rounds z = logit - top, not the logit
    itself. The tokens that carry the softmax's mass have z near 0, where bfloat16 is finest
    (a rounding of 2^-9 instead of a logit of 20's 2^-4). The weight's gradient stays a product
    in the weights' dtype: added up chunk by chunk, a narrow product per chunk would cost its
    rounding and a full (V, H) addition each time."""

    PAD = 32
    """Columns the shifted product's inner dimension gains (one used): matrix kernels like it a
    multiple of 32."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype) -> None:
        vocab, width = weight.shape
        self.width, self.dtype = width, dtype
        self.weight = torch.zeros(vocab, width + self.PAD, dtype=dtype, device=weight.device)
        self.weight[:, :width] = weight.detach()
        self.weight[:, width] = 1.0

    def softmax(self, hidden: torch.Tensor, top: torch.Tensor, temperature: float) -> torch.Tensor:
        """softmax(hidden @ weight.T / temperature) of one chunk, (c, V) float32."""
        rows = torch.zeros(hidden.shape[0], self.width + self.PAD, dtype=self.dtype, device=hidden.device)
        rows[:, : self.width] = hidden.detach() / temperature if temperature != 1.0 else hidden.detach()
        rows[:, self.width] = -top
        probs = (rows @ self.weight.t()).float().exp_()  # (c, V), the largest entry of a row ~1
        return probs.div_(probs.sum(dim=-1, keepdim=True))

    def grad_hidden(self, grad_logits: torch.Tensor) -> torch.Tensor:
        """grad_logits (c, V) @ weight, (c, H), in float32 out of a narrow product."""
        return (grad_logits.to(self.dtype) @ self.weight[:, : self.width]).float()


def token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    chunk: int = DEFAULT_CHUNK,
    backward_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs of `targets` and (detached) entropies, without full logits.

    hidden: (N, H) final hidden states; weight: (V, H) LM head; targets: (N,) token ids.
    Returns (logprobs (N,), entropy (N,)) in float32 under the sampling distribution:
    softmax(logits / temperature) renormalised over the top-k / top-p support.
    `backward_dtype` (e.g. bfloat16, as under autocast): the backward's recomputed logits and
    hidden-state gradient as products in that dtype (not with top-k / top-p, whose support the
    forward's precision decides); the log-probs themselves are unchanged.
    """
    if temperature <= 0:
        raise ValueError("temperature must be > 0 to score tokens (greedy samples have no distribution)")
    return _ChunkedLogprobs.apply(
        hidden, weight, targets, float(temperature), int(top_k), float(top_p), int(chunk), backward_dtype
    )


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
