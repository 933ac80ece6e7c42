"""Attention over packed rows by segment: each sample (or shared prompt) attends within itself.

A packed row holds several sequences end to end. A dense attention over the whole row with a
block-diagonal mask costs the square of the row's length, which on CPU (no variable-length
kernel) can cost more than the padding it removes. This attention runs one causal SDPA call per
segment instead, so the work is the sum of the segments' squares. A completion that shares a
prompt (`shared_prompt` layout) attends to the prompt's keys and then causally to its own,
with the mask aligned to the bottom right (query i sees every prompt key and keys 0..i).

Registered with transformers' `AttentionInterface` under `NAME`; the model's attention
implementation is switched to it by `use_segment_attention`, and the segments travel to it as
the `rollflow_segments` keyword of the decoder's forward (with `NO_MASK` as the mask).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.bias import causal_lower_right

NAME = "rollflow_segments"

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
    if query.dtype != value.dtype:
        # Under bfloat16 autocast the projections come out in bfloat16 but the rotary embedding
        # promotes queries and keys to float32; SDPA takes one dtype, the projections'.
        query, key = query.to(value.dtype), key.to(value.dtype)
    if rollflow_segments is None:  # an ordinary forward (generate, export checks): plain SDPA
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **_)
    if query.shape[0] != 1:
        raise ValueError(f"segment attention takes one packed row, got {query.shape[0]}")
    repeat = query.shape[1] // key.shape[1]
    if repeat > 1:  # grouped-query attention: one key/value head serves `repeat` query heads
        key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
    p = dropout if module.training else 0.0
    pieces = []
    for start, end, p0, p1 in rollflow_segments:
        q = query[:, :, start:end]
        if p1 > p0:
            k = torch.cat([key[:, :, p0:p1], key[:, :, start:end]], dim=2)
            v = torch.cat([value[:, :, p0:p1], value[:, :, start:end]], dim=2)
            bias = causal_lower_right(end - start, k.shape[2])
            pieces.append(F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=p, scale=scaling))
        else:
            k, v = key[:, :, start:end], value[:, :, start:end]
            pieces.append(F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p, scale=scaling))
    out = torch.cat(pieces, dim=2)
    if out.shape[2] != query.shape[2]:
        raise ValueError(f"segments cover {out.shape[2]} of the row's {query.shape[2]} tokens")
    return out.transpose(1, 2).contiguous(), None  # (1, L, heads, D), as transformers expects


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
