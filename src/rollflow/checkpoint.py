"""Atomic checkpoints of a whole run, and finding the one to resume from.

A checkpoint is a folder `checkpoints/step-SSSSSS-NN` (SSSSSS: optimizer steps done, i.e. the
policy version; NN: a serial when one step is saved twice, e.g. periodic then final) holding

- `trainer/`: the model (or adapter) and optimizer tensors, written by every trainer rank with
  torch.distributed.checkpoint (`Trainer.save`);
- `state.msgpack`: everything else as one `RunState` (msgspec): scheduler and step count, RNG
  states, sampler position and the ids drawn so far, the admission count, buffered groups,
  in-flight groups with each sample's progress (tokens, log-probs, per-token versions), and the
  byte lengths of `ledger.jsonl` and `metrics.jsonl` at that moment.

It is written to a hidden temporary folder, fsynced and renamed into place, so a crash or a full
disk at any point leaves the previous checkpoints as they were; `keep_last` are kept. This
module does not decide when to checkpoint or how to restore a run; the controller does.
"""

from __future__ import annotations

import os
import random
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import torch

from rollflow import faults
from rollflow.config import Config
from rollflow.errors import CheckpointError
from rollflow.records import Group, Prompt
from rollflow.rollout import PartialSample

CHECKPOINTS = "checkpoints"
_NAME = re.compile(r"^step-(\d{6,})-(\d{2,})$")


class PendingGroup(msgspec.Struct, kw_only=True):
    """A group still generating: its prompt and each sample's progress."""

    prompt: Prompt
    group_id: str
    samples: list[PartialSample]


class RunState(msgspec.Struct, kw_only=True):
    """Everything of a run a checkpoint holds besides the trainer's tensors."""

    step: int
    """Optimizer steps done: the policy version the resumed engine serves."""
    wall_s: float
    trainer: dict[str, Any]
    """What `Trainer.save` returned: scheduler state, step count."""
    rng: dict[str, Any]
    sampler: dict[str, int]
    consumed: list[str]
    """Ids of every prompt drawn so far, in order."""
    group_seq: int
    started: int
    """Samples ever started (the admission rule's count)."""
    trained: int
    dropped: dict[str, int]
    nonfinite_streak: int = 0
    buffer: list[Group] = []
    in_flight: list[PendingGroup] = []
    ledger_bytes: int = 0
    metrics_bytes: int = 0


def rng_state() -> dict[str, Any]:
    version, internal, gauss = random.getstate()
    return {"python": [version, list(internal), gauss], "torch": torch.get_rng_state().numpy().tobytes()}


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(torch.frombuffer(bytearray(state["torch"]), dtype=torch.uint8))


RESUME_FIXED = ("model.path", "rollout.group_size", "run.groups_per_step", "data", "trainer.lora")
"""Settings a checkpoint depends on: the trainer's tensors (model, adapter), the groups saved in
flight and in the buffer (group size), the admission count (batch size) and the sampler's
position (the prompt source). Anything else (learning rate, max_lag, max_steps, ...) may change."""


def resume_changes(previous: Config, current: Config) -> list[str]:
    """`key: old -> new` for each setting in `RESUME_FIXED` that differs between the run's saved
    config and the one it is being resumed with."""

    def flat(value: Any, prefix: str) -> dict[str, Any]:
        if isinstance(value, dict):
            return {k: v for key, item in value.items() for k, v in flat(item, f"{prefix}.{key}").items()}
        return {prefix: value}

    changes = []
    for key in RESUME_FIXED:
        old, new = previous, current
        for part in key.split("."):
            old, new = getattr(old, part), getattr(new, part)
        before, after = flat(msgspec.to_builtins(old), key), flat(msgspec.to_builtins(new), key)
        changes += [
            f"{k}: {before.get(k)!r} -> {after.get(k)!r}"
            for k in sorted(before | after)
            if before.get(k) != after.get(k)
        ]
    return changes


def checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    root = run_dir / CHECKPOINTS
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = _NAME.match(path.name)
        if match and (path / "state.msgpack").is_file():
            found.append(((int(match[1]), int(match[2])), path))
    return [path for _, path in sorted(found)]


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = checkpoints(run_dir)
    return found[-1] if found else None


def read_state(checkpoint: Path) -> RunState:
    path = checkpoint / "state.msgpack"
    try:
        return msgspec.msgpack.decode(path.read_bytes(), type=RunState)
    except OSError as err:
        raise CheckpointError(f"{path}: cannot read the checkpoint ({err.strerror})") from None
    except msgspec.DecodeError as err:
        raise CheckpointError(f"{path}: not a rollflow checkpoint ({err})") from None


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(
    run_dir: Path, state: RunState, save_tensors: Callable[[Path], dict[str, Any]], *, step: int, keep_last: int
) -> Path:
    """Write a checkpoint atomically; returns its folder.

    `save_tensors(folder)` writes the trainer's tensors and returns the trainer's other state,
    which goes into `state.trainer`. On any failure the temporary folder is removed, earlier
    checkpoints are untouched, and `CheckpointError` says what went wrong.
    """
    root = run_dir / CHECKPOINTS
    existing = checkpoints(run_dir)
    serial = 1 + max((int(m[2]) for p in existing if (m := _NAME.match(p.name)) and int(m[1]) == step), default=-1)
    final = root / f"step-{step:06d}-{serial:02d}"
    tmp = root / f".{final.name}.tmp"
    try:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        state.trainer = save_tensors(tmp / "trainer")
        faults.point("checkpoint-write")
        with (tmp / "state.msgpack").open("wb") as f:
            f.write(msgspec.msgpack.encode(state))
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        os.rename(tmp, final)
        _fsync_dir(root)
    except Exception as err:  # OSError, or torch.distributed.checkpoint's wrapper around one
        shutil.rmtree(tmp, ignore_errors=True)
        previous = f"the previous checkpoint {existing[-1]} is intact" if existing else "no earlier checkpoint exists"
        raise CheckpointError(
            f"checkpoint {final} was not written: {getattr(err, 'strerror', None) or err}; {previous}"
        ) from err
    for old in checkpoints(run_dir)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    faults.point("checkpoint-saved")
    return final


def clean_temporary(run_dir: Path) -> None:
    """Remove half-written checkpoint folders a crash left behind."""
    root = run_dir / CHECKPOINTS
    if root.is_dir():
        for path in root.glob(".step-*.tmp"):
            shutil.rmtree(path, ignore_errors=True)
