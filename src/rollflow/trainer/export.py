"""Weights out of a trainer: whole tensors from FSDP2 shards, LoRA merged into the base weights,
quiet single-process checkpoints. No optimizer state and no engine calls here.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor

PEFT_PREFIX = "base_model.model."


def merged_lora_weights(lm: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every weight in Hugging Face naming with the LoRA update folded in (B @ A × scaling)."""
    from peft.tuners.lora import LoraLayer

    lora_modules = {name: m for name, m in lm.named_modules() if isinstance(m, LoraLayer)}
    for name, tensor in lm.state_dict().items():
        if ".lora_" in name:
            continue
        module_name, _, leaf = name.rpartition(".")
        owner = module_name.removesuffix(".base_layer")
        hf_name = f"{owner}.{leaf}".removeprefix(PEFT_PREFIX)
        whole = full(tensor)
        layer = lora_modules.get(owner)
        if layer is not None and leaf == "weight" and module_name.endswith(".base_layer"):
            adapter = layer.active_adapters[0]
            a = full(layer.lora_A[adapter].weight.detach())  # type: ignore[operator, index]  # (r, in)
            b = full(layer.lora_B[adapter].weight.detach())  # type: ignore[operator, index]  # (out, r)
            whole = whole + (b @ a) * layer.scaling[adapter]
        yield hf_name, whole


@contextlib.contextmanager
def single_process_dcp() -> Iterator[None]:
    """torch.distributed.checkpoint warns on every single-process save, which is intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def full(tensor: torch.Tensor) -> torch.Tensor:
    """A whole tensor from a possibly sharded (DTensor) one."""
    whole = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
    return whole.detach()
