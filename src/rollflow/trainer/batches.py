"""What one micro-batch pass needs: the log-prob module, the rank and micro-batch plans, padding.

`PolicyHead` wraps the causal LM with the chunked log-prob head (full logits never exist);
`plan_shards` splits a batch across ranks by tokens, `plan_micro_batches` packs one rank's
share under a token budget, `pad` turns a micro-batch into tensors; `lr_factor` is the learning
rate schedule. No optimizer and no IO here (`rollflow.trainer.model` owns the step).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from rollflow.config import TrainerConfig
from rollflow.loss import token_logprobs
from rollflow.records import TrainSample


class PolicyHead(nn.Module):
    """Causal LM body + chunked log-prob head: (padded tokens, gather index) -> log-probs.

    Wrapping both in one module lets FSDP2 gather the LM head (and tied embeddings) for the
    custom log-prob function exactly as for any other layer.
    """

    def __init__(self, lm: nn.Module, chunk: int) -> None:
        super().__init__()
        self.lm = lm
        self.chunk = chunk

    def forward(
        self,
        input_ids: torch.Tensor,  # (B, L)
        attention_mask: torch.Tensor,  # (B, L)
        gather: torch.Tensor,  # (N,) flat positions whose hidden state predicts a target
        targets: torch.Tensor,  # (N,)
        temperature: float,
        top_k: int,
        top_p: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        body = self.lm.get_decoder()  # type: ignore[operator]
        hidden = body(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state  # (B, L, H)
        rows = hidden.reshape(-1, hidden.shape[-1]).index_select(0, gather)  # (N, H)
        weight = self.lm.get_output_embeddings().weight  # type: ignore[operator]  # (V, H)
        return token_logprobs(
            rows, weight, targets, temperature=temperature, top_k=top_k, top_p=top_p, chunk=self.chunk
        )


def plan_shards(samples: list[TrainSample], world_size: int) -> list[list[int]]:
    """Split sample indices across ranks, balancing tokens (longest first, to the lightest rank)."""
    shards: list[list[int]] = [[] for _ in range(world_size)]
    load = [0] * world_size
    for i in sorted(range(len(samples)), key=lambda i: -len(samples[i].input_ids)):
        rank = load.index(min(load))
        shards[rank].append(i)
        load[rank] += len(samples[i].input_ids)
    return [sorted(s) for s in shards]


def plan_micro_batches(samples: list[TrainSample], indices: list[int], budget: int) -> list[list[int]]:
    """Group samples into micro-batches whose padded size (count × longest) fits `budget`."""
    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in sorted(indices, key=lambda i: len(samples[i].input_ids)):
        n = len(samples[i].input_ids)
        if current and max(longest, n) * (len(current) + 1) > budget:
            batches.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, n)
    if current:
        batches.append(current)
    return batches


def lr_factor(config: TrainerConfig):
    def factor(step: int) -> float:
        if config.warmup_steps and step < config.warmup_steps:
            return (step + 1) / config.warmup_steps
        if config.schedule == "cosine":
            span = max(1, config.total_steps - config.warmup_steps)
            progress = min(1.0, (step - config.warmup_steps) / span)
            return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))
        return 1.0

    return factor


def pad(samples: list[TrainSample], device: torch.device) -> dict[str, Any]:
    """Pad a micro-batch: token ids, attention mask, gather index and per-token targets."""
    B = len(samples)
    L = max(len(s.input_ids) for s in samples)
    T = max(s.num_completion for s in samples)
    ids = torch.zeros(B, L, dtype=torch.long)
    attn = torch.zeros(B, L, dtype=torch.long)
    behaviour = torch.zeros(B, T)
    mask = torch.zeros(B, T)
    token_adv = torch.zeros(B, T)
    old = torch.zeros(B, T) if samples[0].old_logprobs is not None else None
    gather: list[int] = []
    targets: list[int] = []
    slots: list[int] = []
    for b, s in enumerate(samples):
        n, c = len(s.input_ids), s.num_completion
        ids[b, :n] = torch.tensor(s.input_ids)
        attn[b, :n] = 1
        behaviour[b, :c] = torch.tensor(s.logprobs)
        mask[b, :c] = torch.tensor(s.loss_mask, dtype=torch.float32)
        token_adv[b, :c] = torch.tensor(s.token_advantages) if s.token_advantages is not None else s.advantage
        if old is not None:
            old[b, :c] = torch.tensor(s.old_logprobs)
        # The hidden state at position t predicts token t + 1.
        gather.extend(b * L + t - 1 for t in range(s.prompt_len, n))
        targets.extend(s.input_ids[s.prompt_len :])
        slots.extend(b * T + j for j in range(c))
    to = device
    return {
        "ids": ids.to(to),
        "attn": attn.to(to),
        "gather": torch.tensor(gather, dtype=torch.long, device=to),
        "targets": torch.tensor(targets, dtype=torch.long, device=to),
        "slots": torch.tensor(slots, dtype=torch.long, device=to),
        "behaviour": behaviour.to(to),
        "mask": mask.to(to),
        "token_adv": token_adv.to(to),
        "old": old.to(to) if old is not None else None,
        "shape": (B, T),
    }
