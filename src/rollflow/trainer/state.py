"""What leaves a trainer rank and comes back: its weights (whole, for the engine and `final/`),
its LoRA adapter, and its checkpoint state (model, optimizer, scheduler, step count).

Mixed into `rollflow.trainer.model.Trainer` (which provides what is declared here). With FSDP2
every rank calls these together: gathers and torch.distributed.checkpoint are collective. This
module does not step the model.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rollflow.config import TrainerConfig
from rollflow.trainer.batches import PolicyHead
from rollflow.trainer.export import full, merged_lora_weights, single_process_dcp


class TrainerState:
    """Weights out, checkpoints in and out; mixed into `Trainer`."""

    config: TrainerConfig
    module: PolicyHead
    optimizer: torch.optim.Optimizer
    scheduler: Any
    steps: int
    distributed: bool

    @property
    def lm(self) -> nn.Module:
        return self.module.lm

    def full_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every weight in Hugging Face checkpoint naming, whole (gathered across ranks in
        lockstep: every rank must iterate this together). LoRA adapters are merged in."""
        if self.config.lora.enabled:
            yield from merged_lora_weights(self.lm)
            return
        for name, tensor in self.lm.state_dict().items():
            yield name, full(tensor)

    def weight_specs(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """(name, dtype, whole shape) of every model weight (what `full_weights` yields without
        LoRA), without gathering: FSDP2 DTensors know their full shape."""
        return [(name, t.dtype, tuple(t.shape)) for name, t in self.lm.state_dict().items()]

    def adapter_weights(self) -> dict[str, torch.Tensor]:
        """The LoRA adapter tensors (peft naming), whole."""
        if not self.config.lora.enabled:
            raise ValueError("adapter_weights: trainer.lora.enabled is false")
        from peft import get_peft_model_state_dict

        return {k: full(v) for k, v in get_peft_model_state_dict(self.lm).items()}

    def adapter_config(self) -> dict[str, Any]:
        """The peft adapter config as JSON-ready data (what `adapter_config.json` holds)."""
        return adapter_config_of(self.lm)

    def state_dict(self) -> dict[str, Any]:
        """Model (or adapter), optimizer, scheduler and step count."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optim = get_state_dict(self.module, self.optimizer)
        return {"model": model, "optimizer": optim, "scheduler": self.scheduler.state_dict(), "steps": self.steps}

    def save(self, path: Path) -> dict[str, Any]:
        """Write the model (or adapter) and optimizer tensors to the folder `path` with
        torch.distributed.checkpoint (each rank writes its shard; every rank calls this together);
        returns the rest of the state (scheduler, step count) for the caller to store."""
        import torch.distributed.checkpoint as dcp

        state = self.state_dict()
        with single_process_dcp():
            dcp.save(
                {"model": state["model"], "optimizer": state["optimizer"]},
                checkpoint_id=path,
                no_dist=not self.distributed,
            )
        return {"scheduler": state["scheduler"], "steps": state["steps"]}

    def load(self, path: Path, rest: dict[str, Any]) -> None:
        """Restore what `save` wrote (every rank calls this together)."""
        import torch.distributed.checkpoint as dcp

        state = self.state_dict()  # the layout to load into, optimizer state included
        tensors = {"model": state["model"], "optimizer": state["optimizer"]}
        with single_process_dcp():
            dcp.load(tensors, checkpoint_id=path, no_dist=not self.distributed)
        self.load_state_dict({**tensors, **rest})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(
            self.module, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
        )
        self.scheduler.load_state_dict(state["scheduler"])
        self.steps = int(state["steps"])


def adapter_config_of(lm: nn.Module) -> dict[str, Any]:
    """A peft model's adapter config as JSON-ready data (what `adapter_config.json` holds)."""
    import json

    config: Any = lm.peft_config["default"]  # type: ignore[index]
    return json.loads(json.dumps(config.to_dict(), default=lambda v: sorted(v) if isinstance(v, set) else str(v)))
