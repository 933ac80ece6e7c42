"""Code that runs inside vLLM's worker process (named in `worker_extension_cls`).

vLLM mixes `WorkerExtension` into its worker class, so these methods run next to the model
and are reached from the engine adapter through `collective_rpc`. How weights are loaded
depends on how the CPU backend holds its linear layers (`engine.linear_layout`, passed as
`ROLLFLOW_LINEAR_LAYOUT`):

- `packed` (vLLM's default): each linear layer keeps only oneDNN's packed copy of its weight, so
  a load goes through vLLM's layerwise reload (`reload_weights(weights_iterator=...)`), which
  rebuilds each layer and packs it again; a plain `model.load_weights` would fail;
- `plain`: linear layers keep torch's own weight tensors (vLLM's unpacked fallback), so a load is
  `model.load_weights`, which copies each tensor into the parameter in place; the first load of
  a set of names and shapes is watched (`CopyRecorder`) and later ones copy each tensor straight
  to the same place, without the loader's Python work;
- `staged`: linear layers keep both (vLLM's dispatch is told not to remove the plain weight), so a
  load is `model.load_weights` (watched, then replayed, as in `plain`) and a new packed copy of
  each changed layer. A repeated load can be staged while the engine generates
  (`rollflow_stage`, `rollflow.engine.staging`) and committed in one short engine-core call
  (`rollflow_commit_staged`).

Every source hands the loader views, one bucket at a time, in checkpoint naming:

- safetensors bytes (collective_rpc carries bytes natively; raw tensors would arrive as lists);
- a folder of safetensors files (the `checkpoint` transport);
- a transport's receiving end (`Receiver`, whose class its sender names): views into a
  shared-memory segment of packed buckets (the `shm` transport), or buckets received over a gloo
  group with the trainer (the `gloo` transport).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future
from typing import Any, Protocol

from rollflow.engine.loading import _DISPATCH, LINEAR_LAYOUT, WeightLoading, _keyed
from rollflow.imports import load_function


class WorkerExtension(WeightLoading):
    """Methods added to vLLM's worker; `self` is the worker (the load paths: `WeightLoading`)."""

    _rollflow_receivers: dict[str, Receiver] | None = None
    """The transports' receiving ends, by the `module:Class` their senders name, each made at
    its first use (`rollflow_open_receiver`, `rollflow_receive`)."""

    def rollflow_stage(self, method: str, args: list[Any]) -> Future:
        """Start staging the load `method(*args)` on a thread; the future answers True when it is
        staged (commit it with `rollflow_commit_staged`), False when this load cannot be staged
        (not the `staged` layout, a load from files, or the first load of these names and
        shapes: make it whole), or the error that stopped it. Nothing the forward reads changes."""
        if method == "rollflow_checked":  # its fingerprint goes to the commit, or the whole load made instead
            self._rollflow_expected, method, args = args[0], args[1], list(args[2:])
        if not self.rollflow_stages_updates() or not self._rollflow_stageable(method, args):
            if self._rollflow_stager is not None:
                self._rollflow_stager.stop()  # what an earlier stage left is not this load
            answer: Future = Future()
            answer.set_result(False)
            return answer
        return self._rollflow_staging().start(lambda: _keyed(self._rollflow_incoming(method, args)))

    def rollflow_commit_staged(self) -> int:
        """Make the staged load live: copy its spare tensors in, swap the packed layers."""
        stager = self._rollflow_staging()
        key, staged = stager.dirty, stager.take()
        expected, self._rollflow_expected = self._rollflow_expected, None
        self._rollflow_touched = True
        staged.commit()
        stager.loaded()
        self._rollflow_verify(key, stager.copies.get(key), expected)
        self._rollflow_touched = False
        return len(staged.packed)

    def rollflow_checked(self, fingerprint: Any, method: str, *args: Any) -> Any:
        """The load `method(*args)`, checked against `fingerprint` (`rollflow_expect`): one call
        for both, so a checked update costs no call of its own."""
        if method not in LOADS or method == "rollflow_checked":
            raise ValueError(f"rollflow_checked: {method!r} is not a weight load (one of {sorted(LOADS)})")
        self._rollflow_expected = fingerprint
        try:
            return getattr(self, method)(*args)
        finally:
            self._rollflow_expected = None

    def _rollflow_stageable(self, method: str, args: list[Any]) -> bool:
        """Whether `method(*args)` has all its tensors at hand (bytes read, or a receiver whose
        views are into memory already written: `Receiver.stageable`)."""
        if method == "rollflow_receive":
            return self._rollflow_receiver(args[0]).stageable
        return method in STAGEABLE

    def _rollflow_incoming(self, method: str, args: list[Any]) -> Any:
        """The (name, tensor) pairs a stageable load `method(*args)` would load."""
        if method == "rollflow_receive":
            return self._rollflow_receiver(args[0]).receive(*args[1:])[1]
        from safetensors.torch import load

        return load(args[0]).items()

    def rollflow_distrust(self) -> bool:
        """The loaded weights no longer match the engine's version label (a label or prefix-cache
        reset failed after the load): `rollflow_weights_intact` says so from now on."""
        self._rollflow_touched = True
        return True

    def rollflow_weights_intact(self) -> bool:
        """True unless a reload began and failed part-way (then the model is neither the old
        weights nor the new ones). A failed transfer that never reached the model is intact."""
        return not self._rollflow_touched

    def rollflow_watch_parent(self, interval_s: float = 1.0) -> int:
        """End this process soon after its parent process is gone; returns the parent's pid.

        A client killed outright (SIGKILL, out of memory) never shuts its engine down, and vLLM's
        engine process would live on, holding its memory. A daemon thread checks every
        `interval_s` whether this process has been handed to a new parent (which happens the
        moment the old one exits, even before it is reaped) and then kills this process. Worker
        processes of a multi-process engine watch the engine process the same way.
        """
        import signal

        parent = os.getppid()

        def watch() -> None:
            while os.getppid() == parent:
                time.sleep(interval_s)
            os.kill(os.getpid(), signal.SIGKILL)

        threading.Thread(target=watch, name="rollflow-watch-parent", daemon=True).start()
        return parent

    def rollflow_load_safetensors(self, data: bytes) -> int:
        """Load named tensors serialised with safetensors; returns how many were loaded."""
        from safetensors.torch import load

        tensors = load(data)
        self._rollflow_reload(iter(tensors.items()))
        return len(tensors)

    def rollflow_load_path(self, path: str) -> int:
        """Load every `*.safetensors` file in a folder, one tensor at a time."""
        from pathlib import Path

        from safetensors import safe_open

        files = sorted(Path(path).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{path}: no .safetensors files to load")

        def weights():
            # One tensor at a time from the memory-mapped file: never the whole file in memory.
            for file in files:
                with safe_open(file, framework="pt") as f:
                    for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                        yield name, f.get_tensor(name)

        self._rollflow_reload(weights(), streamed=True)
        return len(files)

    def _rollflow_receiver(self, receiver: str) -> Receiver:
        """The receiving end `receiver` (`module:Class`) names, made on first use."""
        if self._rollflow_receivers is None:
            self._rollflow_receivers = {}
        if receiver not in self._rollflow_receivers:
            self._rollflow_receivers[receiver] = load_function(receiver, "receiver")()
        return self._rollflow_receivers[receiver]

    def rollflow_open_receiver(self, receiver: str, *args: Any) -> bool:
        """Make the receiving end `receiver` names afresh and open it with `args` (the gloo
        transport joins its two-process group there, blocking until the sender is there)."""
        self.rollflow_close_receiver(receiver)
        self._rollflow_receiver(receiver).open(*args)
        return True

    def rollflow_receive(self, receiver: str, *args: Any) -> int:
        """Receive one full set of weights through `receiver` (`args`: what its sender says of
        this load), then load it; returns the bytes received."""
        total, views = self._rollflow_receiver(receiver).receive(*args)
        self._rollflow_reload(iter(views))
        return total

    def rollflow_close_receiver(self, receiver: str) -> bool:
        """Close and forget the receiving end `receiver` names, if one was made."""
        made = (self._rollflow_receivers or {}).pop(receiver, None)
        if made is not None:
            made.close()
        return True


class Receiver(Protocol):
    """A weight transport's receiving end, inside the worker. Its sender names its class
    (`module:Class`, made with no arguments) in the calls it makes (`rollflow_open_receiver`,
    `rollflow_receive`), so this module never imports a transport: the two halves of an update
    meet here."""

    stageable: bool
    """Its loads' tensors are all at hand when `receive` returns (views into memory the sender
    has written), so a load can be staged while the engine generates."""

    def open(self, *args: Any) -> None:
        """Get ready to receive (join a group); some receivers need nothing."""

    def receive(self, *args: Any) -> tuple[int, Iterable[tuple[str, Any]]]:
        """(bytes, named tensors) of one load; `args` are its sender's description of it."""
        ...

    def close(self) -> None: ...


LOADS = frozenset(
    {
        "rollflow_load_safetensors",
        "rollflow_load_path",
        "rollflow_receive",
        "rollflow_commit_staged",
        "rollflow_checked",
    }
)
"""The `WorkerExtension` methods that load weights, the ones `rollflow_update` may run."""

STAGEABLE = frozenset({"rollflow_load_safetensors"})
"""The loads `rollflow_stage` can stage besides a stageable receiver's: their tensors are all at
hand (bytes read)."""


def rollflow_update(
    self: Any, method: str, args: list[Any], version: str, abort: bool, reset: bool, recompute: bool
) -> dict[str, float]:
    """A whole weight update in one engine-core call, added to vLLM's `EngineCore`: abort the
    running requests (`abort`), run the worker's load `method`, label the outputs of every later
    step `version`, reset the prefix cache (`reset`; `recompute`: running requests too, so their
    KV is computed again under the new weights). Returns each part's seconds, and the whole
    call's (`engine core`: the time in which the engine runs no model step).

    The engine core takes calls between two model steps and runs no step until this returns, so
    no step sees the new weights under the old label or the old ones under the new label, and
    requests kept in flight need no pause. If the load fails, nothing after it runs (the worker
    says whether it began changing the model); if the label or the reset fails after the load,
    the worker is told its weights no longer match the label."""
    from rollflow import faults

    if method not in LOADS:
        raise ValueError(f"rollflow_update: {method!r} is not a weight load (one of {sorted(LOADS)})")
    refused = rollflow_update_refused(self)
    if refused:
        raise RuntimeError(f"rollflow_update: {refused}")
    timings: dict[str, float] = {}
    began = called = time.perf_counter()
    if abort:
        from vllm.v1.request import RequestStatus

        self._send_abort_outputs(self.scheduler.finish_requests(None, RequestStatus.FINISHED_ABORTED))
        timings["abort"] = time.perf_counter() - began
        began = time.perf_counter()
    try:
        self.collective_rpc(method, args=tuple(args))
    except Exception as err:
        raise RuntimeError(f"load: {err}") from err
    timings["load"] = time.perf_counter() - began
    part = "label"
    try:
        faults.point("weights-loaded")
        began = time.perf_counter()
        self.set_weight_version(version)
        timings["label"] = time.perf_counter() - began
        if reset:
            part = "reset prefix cache"
            began = time.perf_counter()
            if not self.reset_prefix_cache(reset_running_requests=recompute):
                raise RuntimeError("vLLM could not reset the prefix cache (it returned False)")
            timings["reset prefix cache"] = time.perf_counter() - began
    except Exception as err:
        self.collective_rpc("rollflow_distrust")
        raise RuntimeError(f"{part}, after the new weights were loaded: {err}") from err
    timings["engine core"] = time.perf_counter() - called
    return timings


def rollflow_stage(self: Any, method: str, args: list[Any]) -> Future:
    """Added to vLLM's `EngineCore`: the worker's `rollflow_stage`. The engine core answers the
    call when the future is done and keeps stepping meanwhile."""
    refused = rollflow_update_refused(self)
    if refused:
        raise RuntimeError(f"rollflow_stage: {refused}")
    return self.collective_rpc("rollflow_stage", args=(method, list(args)))[0]


def rollflow_update_refused(self: Any) -> str:
    """Why this engine core cannot run `rollflow_update` ("" when it can): one that steps
    asynchronously may have a step in flight while it takes a call."""
    if getattr(self, "batch_queue", None) is not None:
        return "the engine core keeps a batch queue (a step may be in flight between calls)"
    if not hasattr(self, "_send_abort_outputs"):
        return "the engine core runs in the client's process"
    return ""


def _install() -> None:
    """Run once where vLLM imports this module, before it loads the model: the linear layout,
    and `rollflow_update` on the engine core (when the worker lives in the engine core's process,
    as with one worker; otherwise the engine adapter finds no such call and updates in stages)."""
    if LINEAR_LAYOUT == "plain":
        import vllm._custom_ops as ops

        ops._supports_onednn = False  # vLLM's CPU linear dispatch then keeps torch's weights
    if LINEAR_LAYOUT == "staged":
        from vllm.model_executor.layers import utils

        dispatch = _DISPATCH[0] = utils.dispatch_cpu_unquantized_gemm

        def keep_weight(layer: Any, remove_weight: bool) -> None:
            dispatch(layer, remove_weight=False)  # the plain weight stays, for loads to write into

        utils.dispatch_cpu_unquantized_gemm = keep_weight
    from vllm.v1.engine.core import EngineCore

    EngineCore.rollflow_update = rollflow_update  # type: ignore[attr-defined]
    EngineCore.rollflow_stage = rollflow_stage  # type: ignore[attr-defined]
    EngineCore.rollflow_update_refused = rollflow_update_refused  # type: ignore[attr-defined]


_install()
