"""Attention over packed rows by segment: each sample (or shared prompt) attends within itself.

A packed row holds several sequences end to end. A dense attention over the whole row with a
block-diagonal mask costs the square of the row's length, which on CPU (no variable-length
kernel) can cost more than the padding it removes. This attention runs causal SDPA per segment
instead, so the work is the sum of the segments' squares. A completion that shares a prompt
(`shared_prompt` layout) attends to the prompt's keys and then causally to its own, with the
mask aligned to the bottom right (query i sees every prompt key and keys 0..i). Adjacent
segments of one length with one prefix (a group's completions cut at the same length, as
`max_tokens` cuts many) go through one call as a batch of views, not one call each: on a CPU
the per-call cost and each slice's backward (a zeroed tensor the size of the row) were most of
the attention's time, and for the same reason the row is split into one piece per run.

On a CPU the attention computes in float32 (its output back in the values' dtype), with grouped
heads served by SDPA itself: SDPA's bfloat16 backward there took about twice its float32 one.
Under autocast (bfloat16 values) a run whose scores are few (`SMALL_SCORES`) takes two batched
products instead of SDPA: float32 scores from the float32 queries and keys and their softmax in
float32, then the weighted sum of the bfloat16 values in bfloat16. For SmolLM2's heads and a
group of 8 completions of 128 tokens on a 40-token prompt that is about 33 ms a layer, forward
and backward, against SDPA's 41-48 ms, and its log-probs are as far from a float32 model's as
SDPA's are. The cost is the scores kept for the backward, hence the cap.

Registered with transformers' `AttentionInterface` under `NAME`; the model's attention
implementation is switched to it by `use_segment_attention`, and the segments travel to it as
the `rollflow_segments` keyword of the decoder's forward (with `NO_MASK` as the mask).
"""

from __future__ import annotations

import bisect
import functools
import itertools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.bias import causal_lower_right

NAME = "rollflow_segments"

SMALL_SCORES = 1 << 22
"""The most scores (segments × heads × queries × keys) one run may have to take the two products
on a CPU under autocast rather than SDPA: 4M, 16 MiB of float32 scores kept for the backward."""

Segment = tuple[int, int, int, int]
"""(start, end, prefix start, prefix end): queries start:end attend to the keys of the prefix
(a shared prompt; empty when start == end of the prefix) and causally to their own."""


def segment_attention(
    module: nn.Module,
    query: torch.Tensor,  # (1, heads, L, D)
    key: torch.Tensor,  # (1, kv heads, L, D)
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    rollflow_segments: list[Segment] | None = None,
    **_: Any,
) -> tuple[torch.Tensor, None]:
    if rollflow_segments is None:  # an ordinary forward (generate, export checks): plain SDPA
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        if query.dtype != value.dtype:  # bfloat16 projections, float32 rotary output (autocast)
            query, key = query.to(value.dtype), key.to(value.dtype)
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **_)
    if query.shape[0] != 1:
        raise ValueError(f"segment attention takes one packed row, got {query.shape[0]}")
    p = dropout if module.training else 0.0
    repeat = query.shape[1] // key.shape[1]
    on_cpu, dtype = query.device.type == "cpu", value.dtype
    plan = runs(rollflow_segments)
    sizes = [n * length for _, n, length, _, _ in plan]
    starts = [0, *itertools.accumulate(sizes)][:-1]
    if sum(sizes) != query.shape[2] or starts != [start for start, *_ in plan]:
        raise ValueError(f"segments cover {sum(sizes)} of the row's {query.shape[2]} tokens")
    narrow_values = on_cpu and p == 0.0 and value.dtype in (torch.bfloat16, torch.float16)
    heads = query.shape[1]
    scores = [n * heads * length * (length + p1 - p0) for _, n, length, p0, p1 in plan]
    products = [narrow_values and count <= SMALL_SCORES for count in scores]
    if on_cpu:
        wide = torch.promote_types(torch.promote_types(query.dtype, value.dtype), torch.float32)
        query, key = query.to(wide), key.to(wide)
        wide_value = value if all(products) else value.to(wide)
    else:
        query, key = query.to(value.dtype), key.to(value.dtype)
        if repeat > 1:  # grouped-query attention: one key/value head serves `repeat` query heads
            key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
        wide_value = value
    gqa = on_cpu and repeat > 1
    # Each run's positions as one piece of the row: a split's backward joins the pieces' gradients,
    # where a slice's would zero a gradient the size of the row for each run.
    qs, ks = query.squeeze(0).split(sizes, dim=1), key.squeeze(0).split(sizes, dim=1)
    vs = {False: wide_value.squeeze(0).split(sizes, dim=1), True: value.squeeze(0).split(sizes, dim=1)}
    pieces = []
    with torch.autocast(query.device.type, enabled=False):
        for i, (_start, n, length, p0, p1) in enumerate(plan):
            values = vs[products[i]]
            q, k, v = _batched(qs[i], n, length), _batched(ks[i], n, length), _batched(values[i], n, length)
            if p1 > p0:
                j = bisect.bisect_right(starts, p0) - 1  # the run that holds the prefix
                prefix = slice(p0 - starts[j], p1 - starts[j])
                k = torch.cat([ks[j][None, :, prefix].expand(n, -1, -1, -1), k], dim=2)
                v = torch.cat([values[j][None, :, prefix].expand(n, -1, -1, -1), v], dim=2)
            if products[i]:
                out = _two_products(q, k, v, scaling)
            else:
                mask: dict[str, Any] = {"is_causal": True}
                if p1 > p0:
                    mask = {"attn_mask": causal_lower_right(length, k.shape[2])}
                out = F.scaled_dot_product_attention(q, k, v, dropout_p=p, scale=scaling, enable_gqa=gqa, **mask)
            pieces.append(out.transpose(0, 1).reshape(1, out.shape[1], n * length, out.shape[3]).to(dtype))
    out = torch.cat(pieces, dim=2)
    return out.transpose(1, 2).contiguous(), None  # (1, L, heads, D), as transformers expects


def runs(segments: list[Segment]) -> list[tuple[int, int, int, int, int]]:
    """The segments as runs that one SDPA call takes: (start, segments, length of each, prefix
    start, prefix end), a run being adjacent segments of one length that share one prefix."""
    out: list[tuple[int, int, int, int, int]] = []
    for start, end, p0, p1 in segments:
        if out:
            s, n, length, q0, q1 = out[-1]
            same_prefix = (p0, p1) == (q0, q1) or (p1 == p0 and q1 == q0)  # the same one, or none
            if end - start == length and start == s + n * length and same_prefix:
                out[-1] = (s, n + 1, length, q0, q1)
                continue
        out.append((start, 1, end - start, p0, p1))
    return out


def _two_products(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float | None) -> torch.Tensor:
    """Attention of queries (n, heads, C, D) over keys and values (n, kv heads, K, D), the last C
    keys the queries' own (causal, aligned to the bottom right), as two batched products: float32
    scores and softmax, then the values' dtype for the weighted sum. (n, heads, C, D)."""
    n, heads, length, dim = q.shape
    groups, keys = k.shape[1], k.shape[2]
    repeat = heads // groups
    # Query heads g * repeat .. (g + 1) * repeat - 1 share key head g: one (repeat * C, K) block each.
    bias = _causal_bias(length, keys, repeat, q.device)
    scale = dim**-0.5 if scaling is None else scaling
    qs = q.reshape(n * groups, repeat * length, dim)
    weights = torch.baddbmm(bias, qs, k.reshape(n * groups, keys, dim).transpose(1, 2), alpha=scale).softmax(-1)
    out = torch.bmm(weights.to(v.dtype), v.reshape(n * groups, keys, dim))
    return out.view(n, heads, length, dim)


@functools.lru_cache(maxsize=64)
def _causal_bias(length: int, keys: int, repeat: int, device: torch.device) -> torch.Tensor:
    """(repeat * length, keys), `repeat` copies of one (length, keys) block: 0 where query i may
    see key j (every key before the last `length`, then keys up to its own), -inf elsewhere."""
    allowed = torch.ones(length, keys, dtype=torch.bool, device=device).tril(keys - length)
    return torch.zeros(length, keys, device=device).masked_fill_(~allowed, float("-inf")).repeat(repeat, 1)


def _batched(piece: torch.Tensor, n: int, length: int) -> torch.Tensor:
    """A run's piece of a row (heads, n * length, D) as n segments of `length`,
    (n, heads, length, D): a view."""
    heads, dim = piece.shape[0], piece.shape[2]
    return piece.view(heads, n, length, dim).transpose(0, 1)


NO_MASK = torch.empty(1, 1, 0, 0, dtype=torch.bool)
"""What a packed row passes as its attention mask: transformers hands a 4-D mask to the attention
unchanged, so no (L, L) mask is built for a row whose segments say it all."""


def use_segment_attention(lm: nn.Module) -> None:
    """Switch a transformers model (before any adapter wraps it) to segment attention; forwards
    without segments (generation) keep SDPA and its masks."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(NAME, segment_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    lm.set_attn_implementation(NAME)  # type: ignore[operator]
