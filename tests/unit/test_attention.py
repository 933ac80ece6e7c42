"""Segment attention (rollflow.trainer.attention) against dense attention with the segments' mask."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from rollflow.trainer import attention
from rollflow.trainer.attention import runs, segment_attention

HEADS, KV_HEADS, DIM = 6, 2, 8

# A packed row: two plain samples of one length, then a prompt (10) and five completions sharing
# it, the first three 7 tokens long (one run), then 4 and 7, then a second prompt (3) with two
# completions of 5.
SEGMENTS = [(0, 6, 0, 0), (6, 12, 6, 6), (12, 22, 12, 12)]
SEGMENTS += [(22, 29, 12, 22), (29, 36, 12, 22), (36, 43, 12, 22), (43, 47, 12, 22), (47, 54, 12, 22)]
SEGMENTS += [(54, 57, 54, 54), (57, 62, 54, 57), (62, 67, 54, 57)]
LENGTH = 67


def dense(query, key, value, segments):
    """Every query attends to its prefix's keys and causally to its own segment, as one masked softmax."""
    length = query.shape[2]
    allowed = torch.zeros(length, length, dtype=torch.bool)
    for start, end, p0, p1 in segments:
        allowed[start:end, p0:p1] = True
        allowed[start:end, start:end] = torch.ones(end - start, end - start, dtype=torch.bool).tril()
    repeat = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
    scores = (query @ key.transpose(-1, -2)) / DIM**0.5
    weights = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return (weights @ value).transpose(1, 2)  # (1, L, heads, D)


def test_adjacent_segments_of_one_length_and_prefix_make_one_run():
    assert runs(SEGMENTS) == [
        (0, 2, 6, 0, 0),  # the two plain samples
        (12, 1, 10, 12, 12),  # the prompt (not its completions: they attend to it)
        (22, 3, 7, 12, 22),
        (43, 1, 4, 12, 22),
        (47, 1, 7, 12, 22),
        (54, 1, 3, 54, 54),
        (57, 2, 5, 54, 57),
    ]


@pytest.mark.parametrize(
    ("mixed", "cap"),
    [(False, attention.SMALL_SCORES), (True, 0), (True, attention.SMALL_SCORES)],
    ids=["float32", "bfloat16-values-sdpa", "bfloat16-values-products"],
)
def test_segment_attention_is_dense_attention_under_the_segments_mask_forward_and_backward(mixed, cap, monkeypatch):
    """Batched runs, single segments and grouped heads give what a dense masked attention gives;
    with bfloat16 values and float32 queries (as under autocast) the output is in bfloat16, and
    runs whose scores fit `SMALL_SCORES` take the two products, the others SDPA."""
    monkeypatch.setattr(attention, "SMALL_SCORES", cap)
    products = []
    two_products = attention._two_products
    monkeypatch.setattr(attention, "_two_products", lambda *a: products.append(a[0].shape) or two_products(*a))
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(1, HEADS, LENGTH, DIM, generator=generator, dtype=torch.float64)
    k = torch.randn(1, KV_HEADS, LENGTH, DIM, generator=generator, dtype=torch.float64)
    v = torch.randn(1, KV_HEADS, LENGTH, DIM, generator=generator, dtype=torch.float64)
    upstream = torch.randn(1, LENGTH, HEADS, DIM, generator=generator, dtype=torch.float64)
    module = nn.Module().eval()

    def grads(fn, dtypes):
        leaves = [x.to(dt).detach().requires_grad_(True) for x, dt in zip((q, k, v), dtypes, strict=True)]
        out = fn(*leaves)
        (out.double() * upstream).sum().backward()
        return out.detach().double(), [x.grad.double() for x in leaves], out.dtype

    want, want_grads, _ = grads(lambda a, b, c: dense(a, b, c, SEGMENTS), [torch.float64] * 3)
    dtypes = [torch.float32, torch.float32, torch.bfloat16 if mixed else torch.float32]
    got, got_grads, dtype = grads(
        lambda a, b, c: segment_attention(module, a, b, c, None, rollflow_segments=SEGMENTS)[0], dtypes
    )
    assert dtype == (torch.bfloat16 if mixed else torch.float32)
    assert len(products) == (len(runs(SEGMENTS)) if mixed and cap else 0)
    rel = 2e-2 if mixed else 1e-5  # bfloat16 rounding of the values (and the output), else float32's
    for name, a, b in [("output", got, want), *zip(("query", "key", "value"), got_grads, want_grads, strict=True)]:
        error = float((a - b).abs().max() / b.abs().max())
        assert error <= rel, f"{name}: {error:.3g} of its scale"


def test_segments_that_miss_tokens_of_the_row_are_an_error():
    x = torch.randn(1, HEADS, 10, DIM)
    kv = x[:, :KV_HEADS]
    with pytest.raises(ValueError, match="segments cover 6 of the row's 10 tokens"):
        segment_attention(nn.Module().eval(), x, kv, kv, None, rollflow_segments=[(0, 6, 0, 0)])
