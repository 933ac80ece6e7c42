"""The trained policy out of a run, as a Hugging Face folder every other tool reads.

- `write_model`: whole weights as a model folder (`save_pretrained`: safetensors, the base
  model's config with the weights' dtype, its generation config, the tokenizer with its chat
  template);
- `write_adapter`: a LoRA adapter as peft writes one (`adapter_config.json`,
  `adapter_model.safetensors`) with the tokenizer beside it;
- `export_checkpoint`: either of those from any checkpoint of a run (FSDP2 shards from any number
  of ranks included), read in this one process on the CPU.

A folder appears whole or not at all: it is written beside its place and renamed into it, and
an existing folder there is replaced only once the new one is complete. The controller writes
`DIR/final` at the end of a finished run; `python -m rollflow export` does the rest.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rollflow.errors import CheckpointError, UserInputError

if TYPE_CHECKING:
    from rollflow.config import Config

FINAL = "final"
"""The folder of a finished run that holds its trained policy."""

Writer = Callable[[Path], None]


def write_model(out: Path, base: Path, weights: Mapping[str, torch.Tensor]) -> Path:
    """A Hugging Face model folder at `out` with `weights` (Hugging Face naming, whole) on the
    architecture, generation config and tokenizer of the model folder `base`."""

    def write(tmp: Path) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

        config = AutoConfig.from_pretrained(base)
        dtype = next(t.dtype for t in weights.values() if t.is_floating_point())
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        own = dict(weights)
        tied = bool(getattr(config.get_text_config(), "tie_word_embeddings", False))
        if tied:  # one tensor under two names: load it once, then tie
            own.pop("lm_head.weight", None)
        missing, unexpected = model.load_state_dict(own, strict=False, assign=True)
        missing = [m for m in missing if not (tied and m == "lm_head.weight")]
        if missing or unexpected:
            raise CheckpointError(f"the weights do not fit {base}: missing {missing[:3]}, unexpected {unexpected[:3]}")
        if tied:
            model.tie_weights()
        with contextlib.suppress(OSError):  # the base has none: keep the default one from its config
            model.generation_config = GenerationConfig.from_pretrained(base)
        model.save_pretrained(tmp)
        _save_tokenizer(base, tmp)

    return _write_whole(out, write)


def write_adapter(out: Path, base: Path, weights: Mapping[str, torch.Tensor], config: dict[str, Any]) -> Path:
    """A peft adapter folder at `out`: `weights` (peft naming) and `config` (what
    `adapter_config.json` holds), pointing at the base model folder `base`, plus its tokenizer."""

    def write(tmp: Path) -> None:
        from safetensors.torch import save_file

        adapter = {**config, "base_model_name_or_path": str(base), "inference_mode": True}
        (tmp / "adapter_config.json").write_text(json.dumps(adapter, indent=2, sort_keys=True) + "\n")
        save_file({k: v.contiguous() for k, v in weights.items()}, tmp / "adapter_model.safetensors")
        _save_tokenizer(base, tmp)

    return _write_whole(out, write)


def _save_tokenizer(base: Path, out: Path) -> None:
    from rollflow.models import load_tokenizer

    load_tokenizer(base).save_pretrained(out)


def _write_whole(out: Path, write: Writer) -> Path:
    """Run `write(tmp)` on a fresh folder beside `out`, then put it at `out`."""
    out = out.absolute()
    tmp = out.with_name(f".{out.name}.tmp")
    old = out.with_name(f".{out.name}.old")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        write(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(old, ignore_errors=True)
    if out.exists():
        out.rename(old)
    tmp.rename(out)
    shutil.rmtree(old, ignore_errors=True)
    return out


def find_checkpoint(run_dir: Path, step: int | None) -> Path:
    """The latest checkpoint of `run_dir` (after `step` optimizer steps, when given)."""
    from rollflow.checkpoint import checkpoints, read_state

    found = checkpoints(run_dir)
    if step is not None:
        found = [c for c in found if read_state(c).step == step]
    if found:
        return found[-1]
    have = sorted({read_state(c).step for c in checkpoints(run_dir)})
    which = f"after step {step}" if step is not None else "at all"
    raise UserInputError(
        f"{run_dir}: no checkpoint {which} (steps with one: {have or 'none'}); checkpoints are kept "
        "per checkpoint.keep_last"
    )


def export_checkpoint(run_dir: Path, *, step: int | None = None, out: Path | None = None, merged: bool = False) -> Path:
    """Write the policy of a checkpoint of `run_dir` as a Hugging Face folder; returns it.

    The default folder is `DIR/export/step-N` (`-merged` added for a merged LoRA model). A LoRA
    run gives its adapter folder unless `merged`."""
    from rollflow.checkpoint import read_state
    from rollflow.config import load_config
    from rollflow.models import resolve_model

    config_file = run_dir / "config.toml"
    if not config_file.is_file():
        raise UserInputError(f"{run_dir}: not a rollflow run directory (no config.toml)")
    config = load_config(config_file)
    checkpoint = find_checkpoint(run_dir, step)
    steps = read_state(checkpoint).step
    lora = config.trainer.lora.enabled
    if merged and not lora:
        raise UserInputError("--merged: the run trained the whole model (trainer.lora.enabled is false)")
    if out is None:
        out = run_dir / "export" / (f"step-{steps}" + ("-merged" if merged else ""))
    base = resolve_model(config.model.path)
    lm = load_policy(checkpoint / "trainer", base, config)
    if lora and not merged:
        from peft import get_peft_model_state_dict

        from rollflow.trainer.state import adapter_config_of

        return write_adapter(out, base, get_peft_model_state_dict(lm), adapter_config_of(lm))
    from rollflow.trainer.export import merged_lora_weights

    weights = dict(merged_lora_weights(lm)) if lora else lm.state_dict()
    return write_model(out, base, weights)


def load_policy(tensors: Path, base: Path, config: Config) -> torch.nn.Module:
    """The policy model (peft-wrapped for a LoRA run) on the CPU, with the weights a trainer
    saved to the folder `tensors` (`Trainer.save`, a checkpoint's `trainer/`)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    from transformers import AutoModelForCausalLM

    from rollflow.trainer.batches import PolicyHead
    from rollflow.trainer.export import single_process_dcp
    from rollflow.trainer.model import with_lora

    dtype = torch.bfloat16 if config.trainer.dtype == "bfloat16" else torch.float32
    lm = AutoModelForCausalLM.from_pretrained(base, dtype=dtype)
    if config.trainer.lora.enabled:
        lm = with_lora(lm, config.trainer.lora)  # type: ignore[assignment]
    head = PolicyHead(lm, config.trainer.loss_chunk)  # the module whose names the checkpoint uses
    state = get_model_state_dict(head)
    try:
        with single_process_dcp():
            dcp.load({"model": state}, checkpoint_id=tensors, no_dist=True)
    except Exception as err:  # torch.distributed.checkpoint wraps a read error or a missing key
        raise CheckpointError(f"{tensors}: cannot read the trainer's weights ({err})") from err
    set_model_state_dict(head, state)
    return lm
