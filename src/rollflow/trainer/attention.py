"""Attention over packed rows by segment: each sample (or shared prompt) attends within itself.

A packed row holds several sequences end to end. A dense attention over the whole row with a
block-diagonal mask costs the square of the row's length, which on CPU (no variable-length
kernel) can cost more than the padding it removes. This attention runs causal SDPA per segment
instead, so the work is the sum of the segments' squares. A completion that shares a prompt
(`shared_prompt` layout) attends to the prompt's keys and then causally to its own, with the
mask aligned to the bottom right (query i sees every prompt key and keys 0..i). Adjacent
segments of one length with one prefix (a group's completions cut at the same length, as
`max_tokens` cuts many) go through one SDPA call as a batch of views, not one call each: on a
CPU the per-call cost and each slice's backward (a zeroed tensor the size of the row) were most
of the attention's time. On a CPU the attention also computes in float32 (its output back in the
values' dtype), with grouped heads served by SDPA itself: SDPA's bfloat16 backward there took
about twice its float32 one.

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
    if on_cpu:
        wide = torch.promote_types(torch.promote_types(query.dtype, value.dtype), torch.float32)
        query, key, value = query.to(wide), key.to(wide), value.to(wide)
    else:
        query, key = query.to(value.dtype), key.to(value.dtype)
        if repeat > 1:  # grouped-query attention: one key/value head serves `repeat` query heads
            key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
    gqa = on_cpu and repeat > 1
    pieces = []
    with torch.autocast(query.device.type, enabled=False):
        for start, n, length, p0, p1 in runs(rollflow_segments):
            q = _batched(query, start, n, length)
            k, v = _batched(key, start, n, length), _batched(value, start, n, length)
            mask: dict[str, Any] = {"is_causal": True}
            if p1 > p0:
                k = torch.cat([key[:, :, p0:p1].expand(n, -1, -1, -1), k], dim=2)
                v = torch.cat([value[:, :, p0:p1].expand(n, -1, -1, -1), v], dim=2)
                mask = {"attn_mask": causal_lower_right(length, k.shape[2])}
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=p, scale=scaling, enable_gqa=gqa, **mask)
            pieces.append(out.transpose(0, 1).reshape(1, out.shape[1], n * length, out.shape[3]))
    out = torch.cat(pieces, dim=2).to(dtype)
    if out.shape[2] != query.shape[2]:
        raise ValueError(f"segments cover {out.shape[2]} of the row's {query.shape[2]} tokens")
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


def _batched(x: torch.Tensor, start: int, n: int, length: int) -> torch.Tensor:
    """Positions start .. start + n * length of a row (1, heads, L, D) as n segments of `length`,
    (n, heads, length, D): a view, so its backward adds into one gradient for the whole row."""
    heads, dim = x.shape[1], x.shape[3]
    return x[0, :, start : start + n * length].view(heads, n, length, dim).transpose(0, 1)


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
