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

import weakref

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
    hidden: torch.Tensor,
    weight: torch.Tensor,
    temperature: float,
    top_k: int,
    top_p: float,
    buffers: _Buffers | None = None,
) -> torch.Tensor:
    """Sampling-distribution logits of one chunk, (c, V) float32; truncated entries are -inf.

    Works in place on one (c, V) buffer: `buffers`' logits when given (float32 inputs), else
    one it allocates.
    """
    if buffers is not None and hidden.dtype == torch.float32 and weight.dtype == torch.float32:
        logits = torch.mm(hidden, weight.t(), out=buffers.take("logits", hidden.shape[0]))
    else:
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


class _Buffers:
    """(chunk, V) buffers that a pass's chunks share, one per role, so each chunk writes into
    memory the last one used instead of allocating anew: a fresh 25 MB tensor is fresh pages
    to fault in (and, above the C allocator's threshold, mapped and unmapped each time), which
    cost as much as the exp that filled it."""

    def __init__(self, rows: int, vocab: int, device: torch.device) -> None:
        self.rows, self.vocab, self.device = rows, vocab, device
        self._held: dict[str, torch.Tensor] = {}

    def take(self, role: str, rows: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The first `rows` rows of `role`'s (chunk, V) buffer (contiguous), made in `dtype` on first use."""
        return self.scratch(role, (self.rows, self.vocab), dtype)[:rows]

    def scratch(self, role: str, shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
        """`role`'s buffer, made in `shape` and `dtype` on first use."""
        if role not in self._held:
            self._held[role] = torch.empty(shape, dtype=dtype, device=self.device)
        return self._held[role]


class _ChunkedLogprobs(torch.autograd.Function):
    """log p(target) per token, chunk by chunk; backward recomputes each chunk's logits.

    Peak extra memory is a few (chunk × vocab) buffers plus the LM-head gradient, instead of
    several (tokens × vocab) tensors. With a `backward_dtype` (bfloat16 under autocast) the
    backward's products are in that dtype; the forward, whose log-probs the importance ratio
    takes, stays in the weights' dtype unless a `forward_dtype` is given (`_NarrowHead`).
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, top_k, top_p, chunk, backward_dtype, forward_dtype, grads):  # type: ignore[override]
        out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)  # (N,)
        entropy = torch.empty_like(out)
        tops = torch.empty_like(out)
        buffers = _Buffers(min(chunk, hidden.shape[0]), weight.shape[0], hidden.device)
        narrow = _NarrowHead.when(weight, forward_dtype, top_k, top_p)
        # A narrow forward whose backward is narrow too keeps its exp (e^z, z <= ~0) in that dtype
        # for the backward's softmax, when it fits: the backward then skips its product.
        kept = None
        if grads and narrow is not None and backward_dtype == forward_dtype:
            size = hidden.shape[0] * weight.shape[0] * narrow.weight.element_size()
            if size <= _NarrowHead.KEEP_BYTES:
                kept = torch.empty(hidden.shape[0], weight.shape[0], dtype=narrow.dtype, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk):
            end = min(start + chunk, hidden.shape[0])
            if narrow is not None:  # z = logits - top straight out of the shifted product
                shifted, top = narrow.shifted(
                    hidden[start:end], None, temperature, buffers, "logits", targets[start:end]
                )
                target = shifted.gather(-1, targets[start:end, None])  # (c, 1)
            else:
                shifted = _chunk_logits(hidden[start:end], weight, temperature, top_k, top_p, buffers)  # (c, V)
                top = shifted.amax(dim=-1, keepdim=True)  # (c, 1)
                target = shifted.gather(-1, targets[start:end, None]) - top  # (c, 1)
                shifted.sub_(top)  # z = logits - top, in place
            tops[start:end] = top.squeeze(-1)
            exp = torch.exp(shifted, out=buffers.take("exp", end - start))
            if kept is not None:
                kept[start:end] = exp
            total = exp.sum(dim=-1, keepdim=True)  # (c, 1)
            out[start:end] = (target - total.log()).squeeze(-1)
            # H = -sum p log p = log S - sum(e^z z) / S, with p = e^z / S (-inf z: e^z z = 0);
            # the product in z's buffer.
            weighted = shifted.nan_to_num_(neginf=0.0).mul_(exp).sum(dim=-1)
            entropy[start:end] = total.squeeze(-1).log() - weighted / total.squeeze(-1)
            del shifted, exp  # a chunk not in `buffers` goes before the next is allocated
        ctx.save_for_backward(hidden, weight, targets, tops, kept)
        ctx.settings = (temperature, top_k, top_p, chunk, backward_dtype)
        ctx.mark_non_differentiable(entropy)
        return out, entropy

    @staticmethod
    def backward(ctx, grad_out, _grad_entropy):  # type: ignore[override]
        hidden, weight, targets, tops, kept = ctx.saved_tensors
        temperature, top_k, top_p, chunk, backward_dtype = ctx.settings
        grad_hidden = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        narrow = _NarrowHead.when(weight, backward_dtype, top_k, top_p)
        buffers = _Buffers(min(chunk, hidden.shape[0]), weight.shape[0], hidden.device)
        for start in range(0, hidden.shape[0], chunk):
            end = min(start + chunk, hidden.shape[0])
            h = hidden[start:end]
            if kept is not None:  # the forward's exp, normalised
                grad_logits = buffers.take("probs", end - start).copy_(kept[start:end])
                grad_logits.div_(grad_logits.sum(dim=-1, keepdim=True))
            elif narrow is not None:
                grad_logits = narrow.softmax(h, tops[start:end], temperature, buffers)
            else:
                logits = _chunk_logits(h, weight, temperature, top_k, top_p, buffers)  # (c, V)
                grad_logits, _ = _softmax_(logits, logits.amax(dim=-1, keepdim=True))
            # d log p(y) / d logits = onehot(y) - softmax, times the upstream grad and 1/T; built
            # in place in the softmax's buffer.
            grad_logits.neg_()
            grad_logits.scatter_add_(-1, targets[start:end, None], torch.ones_like(grad_logits[:, :1]))
            grad_logits.mul_((grad_out[start:end] / temperature)[:, None])
            if narrow is not None:
                narrowed = narrow.narrowed(grad_logits, buffers)
                if grad_hidden is not None:
                    grad_hidden[start:end] = narrow.grad_hidden(narrowed)
                if grad_weight is not None:
                    narrow.add_grad_weight(grad_weight, narrowed, h, buffers)
            else:
                if grad_hidden is not None:
                    grad_hidden[start:end] = grad_logits.to(h.dtype) @ weight
                if grad_weight is not None:
                    grad_weight.addmm_(grad_logits.to(h.dtype).t(), h)  # no (V, H) temporary
            del grad_logits  # free this chunk before the next one is allocated
        return grad_hidden, grad_weight, None, None, None, None, None, None, None, None


class _NarrowHead:
    """The LM head's products in a narrow dtype (bfloat16): the backward's, and with a
    `forward_dtype` the forward's too.

    The logits are computed already shifted by each token's largest logit: the weight matrix
    gains a column of ones and the hidden states one of -top, so the product, accumulated in
    float32 inside the kernel, rounds z = logit - top, not the logit itself. The tokens that
    carry the softmax's mass have z near 0, where bfloat16 is finest (a rounding of 2^-9 instead
    of a logit of 20's 2^-4). The backward takes the top the forward saved (or, after a narrow
    forward, the forward's exp itself while it fits `KEEP_BYTES`). A narrow forward guesses it
    from the chunk's own targets (sampled tokens are mostly near the top; the guess is a (c, k)
    product) and computes again only the rows whose z then exceeds `SLACK` (14 % of the rows of
    SmolLM2's own samples): any shift common to a row cancels, so an approximate top costs nothing
    but z's range. The weight's gradient is a narrow product per chunk and per slice of the
    vocabulary, added into the float32 gradient (rounded once per chunk, as autocast rounds any
    layer's)."""

    PAD = 32
    """Columns the shifted product's inner dimension gains (one used): matrix kernels like it a
    multiple of 32."""

    KEEP_BYTES = 256 * 2**20
    """The most a narrow forward keeps of its exp for the backward ((tokens, V) in the narrow
    dtype: 2,048 tokens of a 49,152 vocabulary are 192 MiB); beyond it the backward recomputes."""

    SLACK = 1.0
    """The most a row's z may exceed 0 after a first guess of its top: bfloat16 rounds a z in
    [0.5, 1) by up to 2^-9, below its rounding of the z that carry a softmax's mass."""

    SLICE = 2048
    """Vocabulary rows of the weight gradient per narrow product: a (2048, H) product and its
    float32 copy stay small and in cache on their way into the gradient."""

    _last: _NarrowHead | None = None
    """The last one made: the passes of one optimizer step share a weight, so each pass after the
    first reuses its copy (one (V, H) bfloat16 copy kept between steps)."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype) -> None:
        vocab, width = weight.shape
        self.width, self.dtype = width, dtype
        self.source, self.version = weakref.ref(weight), weight._version
        self.weight = torch.empty(vocab, width + self.PAD, dtype=dtype, device=weight.device)
        self.weight[:, :width] = weight.detach()
        self.weight[:, width] = 1.0
        self.weight[:, width + 1 :] = 0.0

    @classmethod
    def when(cls, weight: torch.Tensor, dtype: torch.dtype | None, top_k: int, top_p: float) -> _NarrowHead | None:
        """The narrow head to use for `weight` in `dtype`, or None: no dtype, the weights' own, or a
        truncated distribution (top-k / top-p), whose support the weights' precision decides."""
        if dtype is None or dtype == weight.dtype or top_k > 0 or top_p < 1.0:
            return None
        return cls.of(weight, dtype)

    @classmethod
    def of(cls, weight: torch.Tensor, dtype: torch.dtype) -> _NarrowHead:
        """The narrow copy of `weight` as it is now: the last one made while `weight` is the same
        tensor, unchanged since (its in-place version counter), and in `dtype`; else a new one."""
        last = cls._last
        if last is None or last.source() is not weight or last.version != weight._version or last.dtype != dtype:
            cls._last = None  # the old copy goes before the new one is made
            last = cls._last = cls(weight, dtype)
        return last

    def shifted(
        self,
        hidden: torch.Tensor,
        top: torch.Tensor | None,
        temperature: float,
        buffers: _Buffers,
        role: str,
        candidates: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(z = hidden @ weight.T / temperature - top, (c, V) float32 in `role`'s buffer; top, (c, 1)
        float32: the shift, as bfloat16 held it). Without a `top`, each row's largest logit among
        the `candidates` (token ids: the chunk's own targets) is a first guess, never far above
        the top; the rows whose z then exceeds `SLACK` somewhere are computed again, shifted by
        their largest z."""
        count = hidden.shape[0]
        rows = torch.zeros(count, self.width + self.PAD, dtype=self.dtype, device=hidden.device)
        rows[:, : self.width] = hidden.detach() / temperature if temperature != 1.0 else hidden.detach()
        narrow = buffers.take("narrow", count, self.dtype)
        if top is None:
            assert candidates is not None
            guesses = self.weight[torch.unique(candidates), : self.width]  # (k, H)
            rows[:, self.width] = -(rows[:, : self.width] @ guesses.t()).amax(dim=-1)
            torch.mm(rows, self.weight.t(), out=narrow)
            over = narrow.amax(dim=-1)  # (c,)
            redo = (over > self.SLACK).nonzero().squeeze(-1)
            if redo.numel():
                again = rows[redo]
                again[:, self.width] -= over[redo]
                rows[redo] = again
                narrow[redo] = again @ self.weight.t()
        else:
            rows[:, self.width] = -top.reshape(-1)
            torch.mm(rows, self.weight.t(), out=narrow)
        return buffers.take(role, count).copy_(narrow), rows[:, self.width : self.width + 1].float().neg()

    def softmax(self, hidden: torch.Tensor, top: torch.Tensor, temperature: float, buffers: _Buffers) -> torch.Tensor:
        """softmax(hidden @ weight.T / temperature) of one chunk, (c, V) float32, in `buffers`."""
        probs, _ = self.shifted(hidden, top, temperature, buffers, "probs")
        probs.exp_()  # the largest entry of a row ~1
        return probs.div_(probs.sum(dim=-1, keepdim=True))

    def narrowed(self, grad_logits: torch.Tensor, buffers: _Buffers) -> torch.Tensor:
        """grad_logits (c, V) in the narrow dtype, in `buffers`."""
        return buffers.take("narrow", grad_logits.shape[0], self.dtype).copy_(grad_logits)

    def grad_hidden(self, narrow: torch.Tensor) -> torch.Tensor:
        """narrow grad_logits (c, V) @ weight, (c, H), in float32 out of a narrow product."""
        return (narrow @ self.weight[:, : self.width]).float()

    def add_grad_weight(
        self, grad_weight: torch.Tensor, narrow: torch.Tensor, hidden: torch.Tensor, buffers: _Buffers
    ) -> None:
        """grad_weight (V, H) += narrow grad_logits (c, V).T @ hidden (c, H), slice by slice."""
        rows = hidden.detach().to(self.dtype)
        product = buffers.scratch("weight_grad", (self.SLICE, self.width), self.dtype)
        wide = buffers.scratch("weight_grad_wide", (self.SLICE, self.width), grad_weight.dtype)
        for v0 in range(0, grad_weight.shape[0], self.SLICE):
            v1 = min(v0 + self.SLICE, grad_weight.shape[0])
            torch.mm(narrow[:, v0:v1].t(), rows, out=product[: v1 - v0])
            grad_weight[v0:v1].add_(wide[: v1 - v0].copy_(product[: v1 - v0]))


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
    forward_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs of `targets` and (detached) entropies, without full logits.

    hidden: (N, H) final hidden states; weight: (V, H) LM head; targets: (N,) token ids.
    Returns (logprobs (N,), entropy (N,)) in float32 under the sampling distribution:
    softmax(logits / temperature) renormalised over the top-k / top-p support.
    `backward_dtype` (e.g. bfloat16, as under autocast): the backward's products (the recomputed
    logits, the gradients of the hidden states and of the weight) in that dtype; the log-probs
    themselves are unchanged. `forward_dtype`: the forward's logits as products in that dtype
    too, each shifted by its row's largest logit, which rounds the log-probs by about bfloat16's
    rounding of the inputs. Neither applies with top-k / top-p, whose support the weights'
    precision decides.
    """
    if temperature <= 0:
        raise ValueError("temperature must be > 0 to score tokens (greedy samples have no distribution)")
    return _ChunkedLogprobs.apply(
        hidden, weight, targets, float(temperature), int(top_k), float(top_p), int(chunk), backward_dtype,
        forward_dtype, torch.is_grad_enabled(),
    )  # fmt: skip


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
