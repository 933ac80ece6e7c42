"""A weight update's fingerprint: proof that the engine holds what the trainer sent.

For every floating-point tensor of an update, `SAMPLES` values spread evenly over it (all of a
smaller one) are reduced to two integer sums over their bits, which any machine computes alike
and which one value off by one step changes. The trainer takes them as it stages the update
(`Expectation`), cast to the dtype the engine holds its weights in (`model.dtype`; the engine's
copy casts the same way); the worker reads the same values back out of the model tensors the
load copied into, after the load, inside the update's critical section (`mismatches`). A tensor
the load left out, or whose samples hold other values, is named; the worker then fails the load
as one that changed the model part-way (the engine is replaced).

Only loads copied straight into the model's own tensors can be read back this way (the `plain`
and `staged` linear layouts; see `rollflow.engine.loading`). This module imports no vLLM.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

Fingerprint = dict[str, Any]
"""`{"names": [...], "dtype": "torch.bfloat16", "sums": [[bit sum, placed bit sum], ...] one per
name}`: what travels to the worker (plain lists, so any rpc carries it)."""

SAMPLES = 512
"""Values sampled per tensor. A step at a reinforcement-learning rate in bfloat16 changes about
1-3 % of a tensor's values, so a tensor left at its old values shows in 512 samples but for a
chance under 1e-4 (and its difference grows with every step it stays behind)."""

RUNS = 8
"""The samples are this many runs of adjacent values, spread evenly over the tensor: reading a
few whole cache lines costs a small part of reading 512 scattered values."""
_RUN = SAMPLES // RUNS


def sampled(tensor: torch.Tensor) -> torch.Tensor:
    """The values of `tensor` a fingerprint sums, `SAMPLES` of them: `RUNS` runs of adjacent
    values in memory order, one at the start of each `RUNS`-th part of it (all of a tensor of
    fewer values). A view where the tensor is contiguous."""
    numel = tensor.numel()
    if numel < SAMPLES:
        return tensor.detach().reshape(-1)
    if tensor.is_contiguous():
        return tensor.detach().as_strided((RUNS, _RUN), (numel // RUNS, 1), tensor.storage_offset())
    return tensor.detach().reshape(-1).unfold(0, _RUN, numel // RUNS)[:RUNS]


_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_PLACE = torch.arange(1, SAMPLES + 1)


def _sums(samples: list[torch.Tensor], dtype: torch.dtype) -> list[list[int]]:
    """Two integer sums over the bits of each of `samples` (the sampled values of one tensor),
    cast to `dtype` (as an engine's copy would): of the values' bit patterns, and of each times
    its place among them (so a value moved is caught too). Integer sums do not depend on the
    order they are added in, so any machine gets the same; one value off by one step changes
    both. All at once: the samples as the rows of one matrix (a shorter one padded with zeros,
    whose bits add nothing)."""
    if not samples:
        return []
    pad = torch.nn.functional.pad
    full = [s if s.ndim == 2 else pad(s.reshape(-1), (0, SAMPLES - s.numel())).view(RUNS, _RUN) for s in samples]
    rows = (
        torch.stack(full).view(len(full), SAMPLES).to(dtype)
    )  # a mix of float dtypes stacks exactly; then the engine's cast
    bits = rows.view(_BITS[rows.element_size()]).long().cpu()
    return torch.stack([bits.sum(1), (bits * _PLACE).sum(1)], 1).tolist()  # wraps past 2**63 alike


class Expectation:
    """The trainer's side: watches the weights of one update go by (`watch`) and, once the last
    has passed, holds their fingerprint as an engine holding them in `dtype` would
    (`fingerprint`; None until then)."""

    def __init__(self, dtype: torch.dtype | str = torch.float32) -> None:
        self.dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        self.fingerprint: Fingerprint | None = None

    def watch(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        names: list[str] = []
        samples: list[torch.Tensor] = []
        for name, tensor in weights:
            if tensor.is_floating_point():
                names.append(name)
                samples.append(sampled(tensor).clone())  # not a view: the tensor may be a gathered copy
            yield name, tensor
        self.fingerprint = {"names": names, "dtype": str(self.dtype), "sums": _sums(samples, self.dtype)}


def of(weights: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype | str = torch.float32) -> Fingerprint:
    """The fingerprint of named tensors at hand, as an engine holding them in `dtype` would."""
    watcher = Expectation(dtype)
    for _ in watcher.watch(weights):
        pass
    assert watcher.fingerprint is not None
    return watcher.fingerprint


def mismatches(
    fingerprint: Fingerprint, held: Iterable[tuple[str, torch.Tensor]], dropped: Iterable[str] = ()
) -> list[str]:
    """What of `fingerprint` the model does not hold: `held` pairs each incoming name with a model
    tensor the load copied it into; `dropped` names the incoming tensors the model's loader copies
    nowhere by design (a tied LM head, which is the embedding). Each entry names the tensor and
    says how it differs; a name of the fingerprint that is neither held nor dropped did not
    arrive. Tensors held in another dtype than the fingerprint's are not checked."""
    index = {name: i for i, name in enumerate(fingerprint["names"])}
    dtype = getattr(torch, fingerprint["dtype"].removeprefix("torch."))
    checked: list[tuple[str, torch.Tensor]] = []
    seen: set[str] = set(dropped)
    for name, tensor in held:
        if name in index:
            seen.add(name)
            if tensor.dtype == dtype:
                checked.append((name, tensor))
    wrong = [f"{name}: not loaded" for name in fingerprint["names"] if name not in seen]
    if checked:
        for (name, _), sums in zip(checked, _sums([sampled(t) for _, t in checked], dtype), strict=True):
            if sums != fingerprint["sums"][index[name]]:
                wrong.append(f"{name}: its sampled values are not the trainer's")
    return wrong
