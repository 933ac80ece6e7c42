"""Ground truth for integration tests: greedy decoding with a plain transformers model."""

from __future__ import annotations

from typing import Any


def greedy_tokens(lm: Any, prompt: list[int], n: int) -> list[int]:
    """`n` greedy tokens after `prompt` from a causal LM (no cache, no EOS handling)."""
    import torch

    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(lm(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]
