"""How a worker loads weights into the model, for each layout of its linear layers.

Mixed into `rollflow.engine.worker.WorkerExtension` (vLLM's worker, `self`): `_rollflow_reload`
takes `(name, tensor)` pairs from any source and loads them as `engine.linear_layout` requires
(`ROLLFLOW_LINEAR_LAYOUT` in this process):

- `packed`: vLLM's layerwise reload, which rebuilds and packs each layer again;
- `plain`: the model's `load_weights` into torch's own tensors in place, watched the first time a
  set of names and shapes is loaded (`CopyRecorder`) and replayed as plain copies afterwards;
- `staged`: the same in-place copies, then each changed layer packed again
  (`_rollflow_load_and_pack`); a repeated load is staged on a thread instead
  (`rollflow.engine.staging.Stager`, made here at the first load).

Where the tensors come from (bytes, files, shared memory, gloo) and the engine-core calls are the
worker's (`rollflow.engine.worker`); this module holds no vLLM import at its top.
"""

from __future__ import annotations

import os
from typing import Any

from torch.overrides import TorchFunctionMode

from rollflow import faults

LINEAR_LAYOUT = os.environ.get("ROLLFLOW_LINEAR_LAYOUT", "staged")
"""`engine.linear_layout` of the engine this process serves (set before vLLM starts it)."""

_DISPATCH: list[Any] = [None]
"""vLLM's own CPU linear dispatch (`dispatch_cpu_unquantized_gemm`), kept when `staged` wraps it."""

_DIRTY = (
    "the plain weights of some linear layers were written by a staged load that was not committed, "
    "so only a load of the same names and shapes, or one that writes every linear weight, can "
    "follow (this load would leave layers packed from those weights)"
)


class WeightLoading:
    """The load paths of vLLM's worker, mixed into `WorkerExtension`; `self` is the worker."""

    _rollflow_touched = False
    """A reload began changing the model and did not finish: its layers may be half-loaded."""

    _rollflow_copies: dict[Any, list[list[Any]]] | None = None
    """Per set of incoming names, dtypes and shapes: the model tensors each one is copied into."""

    _rollflow_stager: Any = None
    """`staged` layout: the `rollflow.engine.staging.Stager` (plans, stage thread, staged load)."""

    _rollflow_expected: Any = None
    """The fingerprint the next load must leave in the model (`rollflow_expect`), or None."""

    def rollflow_expect(self, fingerprint: Any) -> bool:
        """Check the next load against `fingerprint` (`rollflow.engine.fingerprint`, what the
        trainer sent; None: check nothing). A load copied into the model in place reads the
        fingerprint's rows back and fails, as a load that changed the model part-way, when a
        tensor is not there; any other load consumes it unchecked."""
        self._rollflow_expected = fingerprint
        return True

    def _rollflow_verify(self, key: Any, copies: list[list[Any]] | None, expected: Any) -> None:
        """Fail unless the model tensors a load of `key` copied into (`copies`) hold `expected`
        (nothing to check without either). The model is then neither the old weights nor the new:
        `rollflow_weights_intact` says so."""
        if expected is None or copies is None:
            return
        from rollflow.engine.fingerprint import mismatches

        planned = list(zip(key, copies, strict=True))
        held = [(name, target) for (name, _, _), targets in planned for target in targets]
        wrong = mismatches(expected, held, dropped=[name for (name, _, _), targets in planned if not targets])
        if wrong:
            self._rollflow_touched = True
            count = len(expected["names"])
            shown = "; ".join(wrong[:3]) + ("; ..." if len(wrong) > 3 else "")
            raise RuntimeError(
                f"the weights loaded are not what the trainer sent: {len(wrong)} of {count} tensors differ ({shown})"
            )

    def _rollflow_reload(self, weights, *, streamed: bool = False) -> None:
        """Load `(name, tensor)` pairs into the model. `streamed`: each tensor is read from a
        file as it comes, so the in-place path hands them to the model's loader one at a time
        (holding them all to replay the first load's copies would hold the whole model)."""
        if self._rollflow_stager is not None:
            self._rollflow_stager.stop()
        expected, self._rollflow_expected = self._rollflow_expected, None  # this load's, checked or not
        if self.rollflow_stages_updates():
            self._rollflow_load_and_pack(weights, streamed=streamed, expected=expected)
            return
        self._rollflow_touched = True  # every path changes the model tensor by tensor
        if not self.rollflow_loads_in_place():
            self.reload_weights(weights_iterator=weights)  # type: ignore[attr-defined]
        elif streamed:
            self.model_runner.model.load_weights(weights)  # type: ignore[attr-defined]
        else:
            self._rollflow_copy_in_place(_keyed(weights), expected)
        self._rollflow_touched = False

    def _rollflow_load_and_pack(self, weights, *, streamed: bool, expected: Any = None) -> None:
        """`staged` layout, a whole load in the critical section: into the plain weights in place,
        then each changed packed layer packed again from its weight."""
        from rollflow.engine.staging import pack, packed_layers, written_layers

        stager = self._rollflow_staging()
        layers = packed_layers(stager.model)
        if streamed:
            if stager.dirty is not None:  # a file's tensors are not known before they are loaded
                raise RuntimeError(_DIRTY)
            self._rollflow_touched = True
            stager.model.load_weights(weights)
        else:
            key, items = _keyed(weights)
            if stager.refuses(key):
                raise RuntimeError(_DIRTY)
            self._rollflow_touched = True
            self._rollflow_copy_in_place((key, items), expected)
            if key in stager.copies:  # the stage plan (and its spare copies) is made on the stage thread
                layers = written_layers(layers, stager.copies[key])
        for layer in layers:
            layer.cpu_linear = pack(layer, layer.weight, _DISPATCH[0])
        stager.loaded()
        self._rollflow_touched = False

    def _rollflow_staging(self) -> Any:
        """The `staged` layout's `Stager`, made at the first load (it shares the watched copies)."""
        if self._rollflow_stager is None:
            from rollflow.engine.staging import Stager

            if self._rollflow_copies is None:
                self._rollflow_copies = {}
            model = self.model_runner.model  # type: ignore[attr-defined]
            self._rollflow_stager = Stager(model, self._rollflow_copies, _DISPATCH[0])
        return self._rollflow_stager

    def rollflow_stages_updates(self) -> bool:
        """Whether a repeated load can be staged while the engine generates: the `staged` layout
        on the CPU backend with no LoRA layers."""
        return self._rollflow_runs("staged")

    def _rollflow_runs(self, layout: str) -> bool:
        """Whether this engine holds its linear layers in `layout` on the CPU backend, with no
        LoRA layers wrapped around them (a LoRA engine reloads layer by layer)."""
        from vllm.platforms import current_platform

        runner = self.model_runner  # type: ignore[attr-defined]
        return layout == LINEAR_LAYOUT and current_platform.is_cpu() and not getattr(runner, "lora_config", None)

    def _rollflow_copy_in_place(self, keyed: tuple[Any, list[tuple[str, Any]]], expected: Any = None) -> None:
        """The model's `load_weights`, once per set of names and shapes, watched; later loads of
        the same set copy each tensor straight to where that load put it (the loader's name
        mapping and checks are Python work that costs more than copying a small model). The
        incoming tensors are held at once: views into memory the source holds anyway (a
        shared-memory segment, gloo's receive buffers, a safetensors payload already read).
        `expected`: the fingerprint to check the copies against (`_rollflow_verify`)."""
        key, items = keyed
        if self._rollflow_copies is None:
            self._rollflow_copies = {}
        copies = self._rollflow_copies.get(key)
        if copies is not None:
            skip = 1 if faults.skipped("load-copy") else 0  # a loader that silently leaves a tensor out
            for (_, tensor), targets in zip(items[skip:], copies[skip:], strict=True):
                for target in targets:
                    target.copy_(tensor)
            self._rollflow_verify(key, copies, expected)
            return
        recorder = CopyRecorder([tensor for _, tensor in items])
        with recorder:
            self.model_runner.model.load_weights(iter(items))  # type: ignore[attr-defined]
        if recorder.replayable:
            self._rollflow_copies[key] = recorder.targets
            self._rollflow_verify(key, recorder.targets, expected)

    def rollflow_loads_in_place(self) -> bool:
        """Whether a load copies into the model's own tensors: the CPU backend with plain linear
        layers and no LoRA layers wrapped around them. Otherwise vLLM's layerwise reload."""
        return self._rollflow_runs("plain")

    def rollflow_copy_plans(self) -> int:
        """How many sets of weights a load copies straight into the model (see
        `_rollflow_copy_in_place`)."""
        return len(self._rollflow_copies or {})


class CopyRecorder(TorchFunctionMode):
    """Watches one load: which tensors each incoming tensor is copied into. `replayable` stays
    True only if every write into a tensor during the load is `target.copy_(incoming)` with the
    incoming tensor itself as the source (same memory, shape and strides), or a constant fill
    (padding rows); then copying each incoming tensor into its `targets` is the same load."""

    def __init__(self, incoming: list[Any]) -> None:
        super().__init__()
        self._index = {(t.data_ptr(), tuple(t.shape), t.stride(), t.dtype): i for i, t in enumerate(incoming)}
        self.targets: list[list[Any]] = [[] for _ in incoming]
        self.replayable = len(self._index) == len(incoming)  # two incoming tensors alike: ambiguous

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        writes = name == "__setitem__" or "out" in kwargs or (name.endswith("_") and not name.startswith("_"))
        if writes:
            self._note(name, args)
        return func(*args, **kwargs)

    def _note(self, name: str, args: tuple[Any, ...]) -> None:
        import torch

        if name in ("fill_", "zero_") and all(not isinstance(a, torch.Tensor) for a in args[1:]):
            return  # a constant: the same on every load
        source = args[1] if name == "copy_" and len(args) == 2 else None
        if not isinstance(source, torch.Tensor):
            self.replayable = False
            return
        at = self._index.get((source.data_ptr(), tuple(source.shape), source.stride(), source.dtype))
        if at is None:
            self.replayable = False
        else:
            self.targets[at].append(args[0])


def _keyed(weights: Any) -> tuple[tuple[Any, ...], list[tuple[str, Any]]]:
    """Incoming (name, tensor) pairs sorted by name, and their key: what makes two loads alike,
    the names, dtypes and shapes of their tensors in that order. Sorted, the same set of weights
    is one key, and one copy plan, whatever order its source lays them out in (safetensors bytes
    and shm buckets differ)."""
    items = sorted(weights, key=lambda item: item[0])
    return tuple((name, tensor.dtype, tuple(tensor.shape)) for name, tensor in items), items
