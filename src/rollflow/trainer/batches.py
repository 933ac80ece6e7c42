"""What one micro-batch pass needs: the log-prob module, the rank and micro-batch plans, layouts.

`PolicyHead` wraps the causal LM with the log-prob head (`rollflow.trainer.heads`: full logits
never exist);
`plan_shards` splits a batch across ranks by tokens, `plan_micro_batches` fills one rank's
share into micro-batches under a token budget, `pad` turns a micro-batch into tensors in one of
the three layouts (`Layout`: padded rows, one packed row, one packed row with each group's prompt
once); `model_tokens` counts the tokens a batch's plan puts through the model without building
it (what a step costs, for the metrics and the simulator); `lr_factor` is the learning rate
schedule. No optimizer and no IO here (`rollflow.trainer.model` owns the step).
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
from torch import nn

from rollflow.config import TrainerConfig
from rollflow.records import TrainSample
from rollflow.trainer.attention import NO_MASK, Segment
from rollflow.trainer.heads import Head, head_logprobs


class PolicyHead(nn.Module):
    """Causal LM body + chunked log-prob head: (tokens as laid out, gather index) -> log-probs.

    Wrapping both in one module lets FSDP2 gather the LM head (and tied embeddings) for the
    custom log-prob function exactly as for any other layer.
    """

    def __init__(
        self,
        lm: nn.Module,
        chunk: int,
        head: Head = "chunked",
        autocast: torch.dtype | None = None,
        autocast_head: bool = False,
    ) -> None:
        super().__init__()
        self.lm = lm
        self.chunk = chunk
        self.head = head
        """`chunked` or `fused` (`rollflow.trainer.heads.choose_head`)."""
        self.autocast = autocast
        """The dtype the body computes in under `torch.autocast` (`trainer.autocast`), or None.
        The head's backward's products take this dtype (`rollflow.loss.token_logprobs`); its
        log-probs stay in the weights' dtype (bfloat16 logits would round them by ~0.05) unless
        `autocast_head`, which makes the forward's products shifted ones in this dtype too."""
        self.autocast_head = autocast_head

    def forward(
        self,
        input_ids: torch.Tensor,  # (B, L)
        attention_mask: torch.Tensor | None,  # (B, L) padding, or None for a packed row
        positions: torch.Tensor | None,  # (1, L) for a packed row
        segments: list[Segment] | None,  # a packed row's segments (rollflow.trainer.attention)
        gather: torch.Tensor,  # (N,) flat positions whose hidden state predicts a target
        targets: torch.Tensor,  # (N,)
        temperature: float,
        top_k: int,
        top_p: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        body = self.lm.get_decoder()  # type: ignore[operator]
        extra: dict[str, Any] = {}
        if segments is not None:
            extra["rollflow_segments"] = segments
            attention_mask = NO_MASK.to(input_ids.device)
        with torch.autocast(input_ids.device.type, dtype=self.autocast or torch.bfloat16, enabled=bool(self.autocast)):
            out = body(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=False, **extra
            )
        hidden = out.last_hidden_state
        rows = hidden.reshape(-1, hidden.shape[-1]).index_select(0, gather)  # (N, H)
        weight = self.lm.get_output_embeddings().weight  # type: ignore[operator]  # (V, H)
        rows = rows.to(weight.dtype)
        return head_logprobs(
            self.head, rows, weight, targets, temperature=temperature, top_k=top_k, top_p=top_p, chunk=self.chunk,
            backward_dtype=self.autocast, forward_dtype=self.autocast if self.autocast_head else None,
        )  # fmt: skip


Layout = Literal["padded", "packed", "shared_prompt"]


def units(samples: list[TrainSample], indices: list[int], layout: Layout) -> list[list[int]]:
    """The indivisible parts of a plan: one sample each, or (`shared_prompt`) the samples that share
    a prompt, which must meet in one micro-batch for their prompt to be computed once."""
    if layout != "shared_prompt":
        return [[i] for i in indices]
    by_prompt: dict[tuple[int, ...], list[int]] = {}
    for i in indices:
        by_prompt.setdefault(tuple(samples[i].input_ids[: samples[i].prompt_len]), []).append(i)
    return list(by_prompt.values())


def tokens_of(samples: list[TrainSample], unit: list[int], layout: Layout) -> int:
    """Tokens a unit puts through the model: each sample whole, or the prompt once."""
    if layout == "shared_prompt":
        return samples[unit[0]].prompt_len + sum(samples[i].num_completion for i in unit)
    return sum(len(samples[i].input_ids) for i in unit)


def plan_shards(samples: list[TrainSample], world_size: int, layout: Layout = "padded") -> list[list[int]]:
    """Split sample indices across ranks, balancing tokens (largest unit first, to the lightest rank)."""
    shards: list[list[int]] = [[] for _ in range(world_size)]
    load = [0] * world_size
    parts = units(samples, list(range(len(samples))), layout)
    for unit in sorted(parts, key=lambda u: (-tokens_of(samples, u, layout), u[0])):
        rank = load.index(min(load))
        shards[rank].extend(unit)
        load[rank] += tokens_of(samples, unit, layout)
    return [sorted(s) for s in shards]


def plan_micro_batches(
    samples: list[TrainSample], indices: list[int], budget: int, layout: Layout = "padded"
) -> list[list[int]]:
    """Group samples into micro-batches under `budget` tokens.

    `padded`: count × longest fits. `packed`: the sum of the lengths fits (first fit, longest
    first). `shared_prompt`: a group's prompt plus its completions fits; a group too big for one
    micro-batch is split, each part with its own copy of the prompt. A sample larger than the
    budget gets a micro-batch of its own."""
    if layout == "padded":
        return _plan_padded(samples, indices, budget)
    parts: list[list[int]] = []
    for unit in units(samples, indices, layout):
        part: list[int] = []
        for i in sorted(unit, key=lambda i: -len(samples[i].input_ids)):
            if part and tokens_of(samples, [*part, i], layout) > budget:
                parts.append(part)
                part = []
            part.append(i)
        parts.append(part)
    bins: list[tuple[int, list[int]]] = []  # (tokens, indices)
    for part in sorted(parts, key=lambda u: -tokens_of(samples, u, layout)):
        size = tokens_of(samples, part, layout)
        for k, (used, members) in enumerate(bins):
            if used + size <= budget:
                bins[k] = (used + size, members + part)
                break
        else:
            bins.append((size, list(part)))
    return [sorted(members) for _, members in bins]


def model_tokens(samples: list[TrainSample], budget: int, layout: Layout) -> int:
    """The tokens one rank's plan of `samples` puts through the model, padding included: what
    `pad(...)["tokens"]` sums to over the micro-batches of `plan_micro_batches`, without tensors."""
    total = 0
    for micro in plan_micro_batches(samples, list(range(len(samples))), budget, layout):
        if layout == "padded":
            total += len(micro) * max(len(samples[i].input_ids) for i in micro)
        else:
            total += sum(tokens_of(samples, unit, layout) for unit in units(samples, micro, layout))
    return total


def _plan_padded(samples: list[TrainSample], indices: list[int], budget: int) -> list[list[int]]:
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


def pad(samples: list[TrainSample], device: torch.device, layout: Layout = "padded") -> dict[str, Any]:
    """A micro-batch as tensors: token ids and how they attend (`layout`), the gather index of the
    hidden states that predict each completion token, and the per-sample loss inputs, (B, T).

    `padded`: one row per sample, padded to the longest. `packed`: one row, samples end to end,
    positions restarting at each sample. `shared_prompt`: one row holding each group's prompt once,
    followed by its completions, their positions continuing from the prompt's end. In both packed
    layouts `segments` tells the attention (`rollflow.trainer.attention`) what attends to what."""
    B = len(samples)
    T = max(s.num_completion for s in samples)
    behaviour = torch.zeros(B, T)
    mask = torch.zeros(B, T)
    token_adv = torch.zeros(B, T)
    old = torch.zeros(B, T) if samples[0].old_logprobs is not None else None
    slots: list[int] = []
    targets: list[int] = []
    for b, s in enumerate(samples):
        c = s.num_completion
        behaviour[b, :c] = torch.tensor(s.logprobs)
        mask[b, :c] = torch.tensor(s.loss_mask, dtype=torch.float32)
        token_adv[b, :c] = torch.tensor(s.token_advantages) if s.token_advantages is not None else s.advantage
        if old is not None:
            old[b, :c] = torch.tensor(s.old_logprobs)
        targets.extend(s.input_ids[s.prompt_len :])
        slots.extend(b * T + j for j in range(c))
    rows = {"padded": _padded_rows, "packed": _packed_row, "shared_prompt": _shared_prompt_row}[layout](samples)
    to = device
    return {
        "ids": rows["ids"].to(to),
        "attn": rows["attn"].to(to) if rows["attn"] is not None else None,
        "positions": rows["positions"].to(to) if rows["positions"] is not None else None,
        "segments": rows["segments"],
        "gather": torch.tensor(rows["gather"], dtype=torch.long, device=to),
        "targets": torch.tensor(targets, dtype=torch.long, device=to),
        "slots": torch.tensor(slots, dtype=torch.long, device=to),
        "behaviour": behaviour.to(to),
        "mask": mask.to(to),
        "token_adv": token_adv.to(to),
        "old": old.to(to) if old is not None else None,
        "shape": (B, T),
        "tokens": rows["ids"].numel(),
    }


def _padded_rows(samples: list[TrainSample]) -> dict[str, Any]:
    L = max(len(s.input_ids) for s in samples)
    ids = torch.zeros(len(samples), L, dtype=torch.long)
    attn = torch.zeros(len(samples), L, dtype=torch.long)
    gather: list[int] = []
    for b, s in enumerate(samples):
        n = len(s.input_ids)
        ids[b, :n] = torch.tensor(s.input_ids)
        attn[b, :n] = 1
        # The hidden state at position t predicts token t + 1.
        gather.extend(b * L + t - 1 for t in range(s.prompt_len, n))
    return {"ids": ids, "attn": attn, "positions": None, "segments": None, "gather": gather}


def _packed_row(samples: list[TrainSample]) -> dict[str, Any]:
    ids: list[int] = []
    positions: list[int] = []
    segments: list[Segment] = []
    gather: list[int] = []
    for s in samples:
        start, n = len(ids), len(s.input_ids)
        ids.extend(s.input_ids)
        positions.extend(range(n))
        segments.append((start, start + n, start, start))
        gather.extend(start + t - 1 for t in range(s.prompt_len, n))
    return _one_row(ids, positions, segments, gather)


def _one_row(ids: list[int], positions: list[int], segments: list[Segment], gather: list[int]) -> dict[str, Any]:
    """A packed micro-batch: one row, no padding mask; `segments` say what attends to what."""
    return {
        "ids": torch.tensor([ids]),
        "attn": None,
        "positions": torch.tensor([positions]),
        "segments": segments,
        "gather": gather,
    }


def _shared_prompt_row(samples: list[TrainSample]) -> dict[str, Any]:
    ids: list[int] = []
    positions: list[int] = []
    segments: list[Segment] = []
    first_slot = [0]  # sample -> its first entry in the gather index (completions in sample order)
    for s in samples:
        first_slot.append(first_slot[-1] + s.num_completion)
    gather = [0] * first_slot[-1]
    for group in units(samples, list(range(len(samples))), "shared_prompt"):
        P, p0 = samples[group[0]].prompt_len, len(ids)
        ids.extend(samples[group[0]].input_ids[:P])
        positions.extend(range(P))
        segments.append((p0, p0 + P, p0, p0))
        for b in group:
            s, start, c = samples[b], len(ids), samples[b].num_completion
            ids.extend(s.input_ids[P:])
            positions.extend(range(P, P + c))
            segments.append((start, start + c, p0, p0 + P))
            # A completion's first token is predicted by its prompt's last position.
            gather[first_slot[b] : first_slot[b] + c] = ([p0 + P - 1] + [start + j for j in range(c - 1)])[:c]
    return _one_row(ids, positions, segments, gather)
