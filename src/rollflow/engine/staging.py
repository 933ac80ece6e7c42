"""Staged weight loads for the CPU backend's `staged` linear layout (runs in the engine process).

With `engine.linear_layout = "staged"` each linear layer keeps oneDNN's packed copy of its weight,
which the model's forward reads, and also torch's plain tensor, which nothing reads while the
engine generates. A load whose copies are known (the first load of the same names and shapes was
watched, see `rollflow.engine.loading.CopyRecorder`) is then made in two parts:

- the stage, on a thread while the engine keeps generating: each incoming tensor is copied into
  the plain weight of its linear layer, or, where the forward reads the tensor itself (embeddings,
  norms, biases, a layer with no packed copy), into a spare copy of that tensor's storage; then
  every changed layer is packed again (oneDNN and torch's copies release Python's GIL);
- the commit, one engine-core call between two model steps: the spare copies are copied into the
  live tensors and each changed layer is given its new packed weight.

`Stager` holds one worker's staging state (plans, the stage thread, the staged load, the key of
a stage that was not committed); the worker decides when to stage and what a failure means
(`rollflow.engine.worker`).
"""

from __future__ import annotations

import threading
import types
from collections.abc import Callable, Hashable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from rollflow import faults


def holds_packed_copy(layer: Any) -> bool:
    """Whether vLLM's CPU linear dispatch gave `layer` a weight of its own (a oneDNN handler or a
    packed tensor) that its matrix products read instead of `layer.weight`. The fallback to
    torch's linear, and any dispatch that keeps a view of `layer.weight`, read the weight live."""
    import torch

    cells = getattr(getattr(layer, "cpu_linear", None), "__closure__", None) or ()
    held = [cell.cell_contents for cell in cells]
    if not held:
        return False
    own = layer.weight.untyped_storage().data_ptr()
    return not any(isinstance(v, torch.Tensor) and v.untyped_storage().data_ptr() == own for v in held)


def packed_layers(model: Any) -> list[Any]:
    """The model's layers whose matrix products read a packed copy of their 2-D weight."""
    return [
        m
        for m in model.modules()
        if hasattr(m, "cpu_linear") and getattr(m, "weight", None) is not None and m.weight.ndim == 2
        if not m.weight.is_meta and holds_packed_copy(m)
    ]


def written_layers(layers: list[Any], targets: list[list[Any]]) -> list[Any]:
    """Those of `layers` whose weight a load with these copies writes into (to pack again)."""
    written = {target.untyped_storage().data_ptr() for copies in targets for target in copies}
    return [m for m in layers if m.weight.untyped_storage().data_ptr() in written]


def pack(layer: Any, source: Any, dispatch: Callable[..., None]) -> Callable[..., Any]:
    """A new matrix-product function for `layer` packed from `source` (the layer is not changed):
    vLLM's dispatch run on a stand-in holding only the weight, so it reads nothing else of the
    layer and replaces nothing in it."""
    stand_in = types.SimpleNamespace(weight=source)
    dispatch(stand_in, remove_weight=False)
    return stand_in.cpu_linear


def _view(storage: Any, like: Any) -> Any:
    """A tensor over `storage` with the dtype, offset, shape and strides of `like`."""
    import torch

    return torch.empty(0, dtype=like.dtype).set_(storage, like.storage_offset(), like.shape, like.stride())


def _linear(layer: Any) -> bool:
    """Whether `layer` is one of vLLM's linear layers, whose forward reads only the packed copy
    (an embedding's weight is read by the lookup too, so it is staged in a spare copy)."""
    from vllm.model_executor.layers.linear import LinearBase

    return isinstance(layer, LinearBase)


@dataclass
class Staged:
    """A staged load, ready to commit: what to copy into the live tensors, what to swap."""

    live: list[tuple[Any, Any]]
    """(live tensor, its spare copy) for each tensor the forward reads."""
    packed: list[tuple[Any, Callable[..., Any]]]
    """(layer, its new matrix-product function)."""

    def commit(self) -> None:
        for target, spare in self.live:
            target.copy_(spare)
        for layer, linear in self.packed:
            layer.cpu_linear = linear


class Cancelled(Exception):
    """The stage was stopped before it finished (nothing live was changed)."""


@dataclass
class StagePlan:
    """Where each incoming tensor of one set of names and shapes goes when staged."""

    writes: list[list[Any]]
    """Per incoming tensor: the plain linear weights or spare views the stage copies it into."""
    live: list[tuple[Any, Any]]
    """(live view, spare view) the commit copies, one per write into a tensor the forward reads."""
    spares: list[tuple[Any, Any]]
    """(live storage, spare storage), refreshed before each stage: a layer packed from a spare
    must see the parts of it this load does not write as they are live."""
    layers: list[tuple[Any, Any]]
    """(layer, tensor to pack it from) for each packed layer this load writes into."""
    covers_all: bool
    """Whether the load writes every element of every plain linear weight."""

    def stage(self, items: Iterable[tuple[str, Any]], dispatch: Callable[..., None], stop: threading.Event) -> Staged:
        for live, spare in self.spares:
            spare.copy_(live)
        skip = 1 if faults.skipped("load-copy") else 0  # a loader that silently leaves a tensor out
        for (_, tensor), writes in zip(list(items)[skip:], self.writes[skip:], strict=True):
            if stop.is_set():
                raise Cancelled
            for target in writes:
                target.copy_(tensor)
        faults.point("stage")
        packed = []
        for layer, source in self.layers:
            if stop.is_set():
                raise Cancelled
            packed.append((layer, pack(layer, source, dispatch)))
        return Staged(live=self.live, packed=packed)


def plan_stage(model: Any, targets: list[list[Any]]) -> StagePlan | None:
    """A stage plan from the copies a watched load made (`targets[i]`: the model tensors the i-th
    incoming tensor was copied into), or None when a target is in no parameter or buffer of
    the model (then where the forward reads it is unknown, and the load is made whole)."""
    layers = packed_layers(model)
    cold = {m.weight.untyped_storage().data_ptr(): m.weight.numel() for m in layers if _linear(m)}
    owned = {t.untyped_storage().data_ptr(): t for t in (*model.parameters(), *model.buffers())}
    spares: dict[int, tuple[Any, Any]] = {}
    writes: list[list[Any]] = []
    live: list[tuple[Any, Any]] = []
    written: dict[int, int] = {}
    for copies in targets:
        dests = []
        for target in copies:
            at = target.untyped_storage().data_ptr()
            written[at] = written.get(at, 0) + target.numel()
            if at in cold:
                dests.append(target)
                continue
            if at not in owned:
                return None
            if at not in spares:
                storage = target.untyped_storage()
                spares[at] = (storage, storage.clone())
            spare = _view(spares[at][1], target)
            dests.append(spare)
            live.append((target, spare))
        writes.append(dests)
    chosen = []
    for m in written_layers(layers, targets):
        at = m.weight.untyped_storage().data_ptr()
        chosen.append((m, m.weight if at in cold else _view(spares[at][1], m.weight)))
    return StagePlan(
        writes=writes,
        live=live,
        spares=list(spares.values()),
        layers=chosen,
        covers_all=all(written.get(at, 0) >= numel for at, numel in cold.items()),
    )


Keyed = tuple[Hashable, list[tuple[str, Any]]]
"""A load's key (what makes two loads alike) and its incoming (name, tensor) pairs, in order."""


class Stager:
    """One worker's staging: a stage plan per key of the watched loads (`copies`: the model
    tensors each incoming tensor of a key's first load was copied into, kept by the worker), at
    most one stage thread, the load it staged, and the key of a stage that wrote plain linear
    weights and was not committed (`dirty`).

    Until a load rewrites them, those plain weights no longer match their layers' packed copies,
    so while `dirty` is set only a load of the same key, or one that writes every plain linear
    weight, may follow (`refuses`)."""

    def __init__(self, model: Any, copies: dict[Hashable, list[list[Any]]], dispatch: Callable[..., None]) -> None:
        self.model = model
        self.copies = copies
        self.dispatch = dispatch
        self.plans: dict[Hashable, StagePlan | None] = {}
        self.dirty: Hashable | None = None
        self._thread: tuple[threading.Thread, threading.Event] | None = None
        self._staged: Staged | None = None

    def plan(self, key: Hashable) -> StagePlan | None:
        """The stage plan of a watched load's key (None: no replayable copies, or not stageable)."""
        if key not in self.copies:
            return None
        if key not in self.plans:
            self.plans[key] = plan_stage(self.model, self.copies[key])
        return self.plans[key]

    def refuses(self, key: Hashable) -> bool:
        """Whether a load of `key` must be refused: the plain weights a stage that was not
        committed wrote (`dirty`) would not all be rewritten by it."""
        if self.dirty in (None, key):
            return False
        plan = self.plan(key)
        return plan is None or not plan.covers_all

    def start(self, incoming: Callable[[], Keyed]) -> Future:
        """Stage the load `incoming()` returns on a thread. The future answers True when it is
        staged (then `take` it), False when it cannot be (no plan for its key, refused, or
        stopped), or the error that ended it. Nothing a model step reads changes."""
        self.stop()
        answer: Future = Future()
        stop = threading.Event()

        def run() -> None:
            try:
                key, items = incoming()
                plan = self.plan(key)
                if plan is None or self.refuses(key):
                    answer.set_result(False)
                    return
                self.dirty = key
                self._staged = plan.stage(items, self.dispatch, stop)
                answer.set_result(True)
            except Cancelled:
                answer.set_result(False)
            except BaseException as err:
                answer.set_exception(err)

        thread = threading.Thread(target=run, name="rollflow-stage", daemon=True)
        self._thread = (thread, stop)
        thread.start()
        return answer

    def stop(self) -> None:
        """Stop the stage thread, if one runs, wait for it (at most one tensor's copy), and drop
        what it staged: a load made after it must not be followed by that one's commit."""
        if self._thread is not None:
            thread, stop = self._thread
            stop.set()
            thread.join()
            self._thread = None
        self._staged = None

    def take(self) -> Staged:
        """The staged load, to commit (then call `loaded`); an error if nothing is staged."""
        staged, self._staged = self._staged, None
        if staged is None or self._thread is None:
            raise RuntimeError("nothing is staged (rollflow_stage first)")
        self._thread[0].join()  # it has answered; let it end
        self._thread = None
        return staged

    def loaded(self) -> None:
        """A load made every plain weight it wrote match its packed copy again."""
        self.dirty = None
