"""The worker's load paths, with a stand-in model (the real engine's loads are in
tests/integration/test_weight_sync.py): what each path holds in memory while it loads."""

from __future__ import annotations

import weakref
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

pytest.importorskip("vllm")


class Model:
    """Copies each incoming tensor into its parameter, noting how many earlier incoming tensors
    are still alive at each one (a streamed load has let go of them)."""

    def __init__(self, params: dict[str, torch.Tensor]) -> None:
        self.params = params
        self.alive_before: list[int] = []

    def load_weights(self, weights) -> None:
        seen: list[weakref.ref] = []
        for name, tensor in weights:
            self.alive_before.append(sum(ref() is not None for ref in seen))
            self.params[name].copy_(tensor)
            seen.append(weakref.ref(tensor))
            del tensor


def worker(model: Model):
    from rollflow.engine.worker import WorkerExtension

    class Worker(WorkerExtension):
        def __init__(self) -> None:
            self.model_runner = SimpleNamespace(model=model)

        def rollflow_loads_in_place(self) -> bool:
            return True

        def rollflow_stages_updates(self) -> bool:
            return False  # the `plain` layout's path

    return Worker()


def test_a_load_from_files_in_place_reads_one_tensor_at_a_time(tmp_path):
    incoming = {f"layer{i}.weight": torch.full((256, 256), float(i)) for i in range(6)}
    save_file(dict(list(incoming.items())[:3]), tmp_path / "a.safetensors")
    save_file(dict(list(incoming.items())[3:]), tmp_path / "b.safetensors")
    model = Model({name: torch.zeros(256, 256) for name in incoming})
    w = worker(model)
    assert w.rollflow_load_path(str(tmp_path)) == 2
    assert all(torch.equal(model.params[name], tensor) for name, tensor in incoming.items())
    assert model.alive_before == [0] * 6  # never the whole model in memory
    assert w.rollflow_copy_plans() == 0 and not w._rollflow_touched


def test_a_load_of_held_views_in_place_is_watched_then_replayed():
    incoming = {f"layer{i}.weight": torch.full((8, 8), float(i)) for i in range(4)}
    model = Model({name: torch.zeros(8, 8) for name in incoming})
    w = worker(model)
    w._rollflow_reload(iter(incoming.items()))
    assert w.rollflow_copy_plans() == 1 and len(model.alive_before) == 4
    again = {name: tensor + 10 for name, tensor in incoming.items()}
    w._rollflow_reload(iter(again.items()))
    assert len(model.alive_before) == 4  # the replay copied without the model's loader
    assert all(torch.equal(model.params[name], tensor) for name, tensor in again.items())


def test_shm_loads_of_the_same_plan_reuse_the_views_and_read_the_rewritten_bytes():
    from rollflow.weight_sync.buckets import plan_buckets
    from rollflow.weight_sync.shm import RECEIVER, ShmSender

    incoming = {f"layer{i}.weight": torch.full((8, 8), float(i)) for i in range(4)}
    plan = plan_buckets([(name, t.dtype, tuple(t.shape)) for name, t in incoming.items()])
    model = Model({name: torch.zeros(8, 8) for name in incoming})
    w = worker(model)
    sender = ShmSender()
    try:
        sender.write(plan, incoming.items())
        assert w.rollflow_receive(RECEIVER, sender.name, plan.encode()) == plan.total_bytes
        receiver = w._rollflow_receivers[RECEIVER]
        views = receiver._views[1][1]
        again = {name: tensor + 10 for name, tensor in incoming.items()}
        sender.write(plan, again.items())  # in place, as between two updates
        assert w.rollflow_receive(RECEIVER, sender.name, plan.encode()) == plan.total_bytes
        assert receiver._views[1][1] is views  # not made again
        assert all(torch.equal(model.params[name], tensor) for name, tensor in again.items())
        # Another plan (here: fewer tensors, in the same segment) gets views of its own.
        fewer = dict(list(incoming.items())[:2])
        smaller = plan_buckets([(name, t.dtype, tuple(t.shape)) for name, t in fewer.items()])
        sender.write(smaller, fewer.items())
        w.rollflow_receive(RECEIVER, sender.name, smaller.encode())
        assert [name for name, _ in receiver._views[1][1]] == list(fewer)
        assert all(torch.equal(model.params[name], tensor) for name, tensor in fewer.items())
        assert w.rollflow_close_receiver(RECEIVER) and RECEIVER not in w._rollflow_receivers
        assert receiver._mapping is None and receiver._views is None
    finally:
        sender.close()
