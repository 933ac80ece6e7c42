"""A weight update proves it landed: the fingerprint the trainer takes of what it sends, read back
by the worker from the model after a load copied in place. Pure functions and the worker's load
paths with a stand-in model; the real engine is in tests/integration/test_update_failure.py."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch

from rollflow import faults
from rollflow.engine import fingerprint
from rollflow.weight_sync import expecting


def weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(50, 8, generator=g) * 0.02,
        "layer.proj.weight": torch.randn(16, 8, generator=g) * 0.02,
        "layer.norm.weight": torch.ones(8) + torch.randn(8, generator=g) * 1e-3,
        "steps": torch.tensor([3]),  # not floating point: not fingerprinted
    }


def test_identical_tensors_match_in_the_dtype_the_engine_holds():
    sent = weights()
    printed = fingerprint.of(sent.items())
    assert printed["names"] == ["embed.weight", "layer.proj.weight", "layer.norm.weight"]
    assert fingerprint.mismatches(printed, sent.items()) == []
    # An engine in bfloat16 holds what its copy cast; the trainer sent float32.
    held = [(name, t.to(torch.bfloat16)) for name, t in sent.items() if t.is_floating_point()]
    assert fingerprint.mismatches(fingerprint.of(sent.items(), "bfloat16"), held) == []
    assert len(fingerprint.mismatches(printed, [(n, t.half()) for n, t in held])) == 0  # another dtype: unchecked
    # A large tensor: 512 values spread over it, the same on both sides.
    big = torch.randn(1000, 64)
    assert fingerprint.sampled(big).numel() == fingerprint.SAMPLES
    starts = [i * 8000 for i in range(8)]  # 64000 values: runs of 64 at the start of each eighth
    want = torch.cat([big.reshape(-1)[at : at + 64] for at in starts])
    assert torch.equal(fingerprint.sampled(big).reshape(-1), want)
    want_t = torch.cat([big.T.reshape(-1)[at : at + 64] for at in starts])
    assert torch.equal(fingerprint.sampled(big.T).reshape(-1), want_t)  # not contiguous: the same places


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("row", ["first", "middle", "last"])
def test_one_sampled_value_off_by_one_step_is_named(dtype, row):
    sent = weights()
    held = {name: t.to(dtype).clone() for name, t in sent.items() if t.is_floating_point()}
    at = {"first": 0, "middle": 25, "last": 49}[row]
    value = held["embed.weight"][at, 3]
    held["embed.weight"][at, 3] = torch.nextafter(value, torch.tensor(1.0, dtype=dtype))
    wrong = fingerprint.mismatches(fingerprint.of(sent.items(), dtype), held.items())
    assert wrong == ["embed.weight: its sampled values are not the trainer's"]


def test_two_sampled_values_swapped_are_named():
    sent = weights()
    held = {name: t.clone() for name, t in sent.items() if t.is_floating_point()}
    held["layer.proj.weight"][[0, 1]] = held["layer.proj.weight"][[1, 0]]  # the same values, moved
    wrong = fingerprint.mismatches(fingerprint.of(sent.items()), held.items())
    assert wrong == ["layer.proj.weight: its sampled values are not the trainer's"]


def test_a_tensor_the_load_left_out_is_named():
    sent = weights()
    held = [(name, t) for name, t in sent.items() if name != "layer.norm.weight"]
    assert fingerprint.mismatches(fingerprint.of(sent.items()), held) == ["layer.norm.weight: not loaded"]
    # A tensor the model's loader copies nowhere on every load (a tied LM head) is not missing.
    assert fingerprint.mismatches(fingerprint.of(sent.items()), held, dropped=["layer.norm.weight"]) == []


def test_the_trainer_side_holds_its_fingerprint_only_once_every_weight_went_by():
    watcher = fingerprint.Expectation()
    seen = watcher.watch(weights().items())
    next(seen)
    assert watcher.fingerprint is None  # a transport that stopped early checks nothing
    list(seen)
    assert watcher.fingerprint == fingerprint.of(weights().items())


class Model:
    """Copies each incoming tensor into its parameter; one it has no parameter for (a tied LM
    head: the embedding is that weight) it skips, as vLLM's loaders do."""

    def __init__(self, params: dict[str, torch.Tensor]) -> None:
        self.params = params

    def load_weights(self, weights) -> None:
        for name, tensor in weights:
            if name in self.params:
                self.params[name].copy_(tensor)


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


@pytest.fixture
def skip_a_tensor_once(monkeypatch):
    """The loader's replay silently leaves a tensor out, the first time it is asked."""
    monkeypatch.setenv("ROLLFLOW_FAULT", "load-copy:1:skip")
    monkeypatch.setattr(faults, "_seen", {})


def test_a_replayed_load_that_leaves_a_tensor_out_passes_unchecked(skip_a_tensor_once):
    """What a sync without the check does: the load succeeds, the model holds the old tensor."""
    incoming = {name: t for name, t in weights().items() if t.is_floating_point()}
    model = Model({name: torch.zeros_like(t) for name, t in incoming.items()})
    w = worker(model)
    w._rollflow_reload(iter(incoming.items()))  # watched
    again = {name: t + 1 for name, t in incoming.items()}
    w._rollflow_reload(iter(again.items()))  # replayed, and the fault leaves the first out
    assert w.rollflow_weights_intact()
    assert not torch.equal(model.params["embed.weight"], again["embed.weight"])


def test_a_replayed_load_that_leaves_a_tensor_out_fails_its_check(skip_a_tensor_once):
    incoming = {name: t for name, t in weights().items() if t.is_floating_point()}
    model = Model({name: torch.zeros_like(t) for name, t in incoming.items()})
    w = worker(model)
    assert w.rollflow_expect(fingerprint.of(incoming.items()))
    w._rollflow_reload(iter(incoming.items()))  # watched, and checked
    assert w._rollflow_expected is None and w.rollflow_weights_intact()
    again = {name: t + 1 for name, t in incoming.items()}
    w.rollflow_expect(fingerprint.of(again.items()))
    with pytest.raises(RuntimeError, match=r"not what the trainer sent: 1 of 3 tensors differ \(embed\.weight: "):
        w._rollflow_reload(iter(again.items()))
    assert not w.rollflow_weights_intact()  # neither the old weights nor the new: the engine goes


def test_a_tensor_the_loader_skips_on_every_load_is_not_missing():
    incoming = {name: t for name, t in weights().items() if t.is_floating_point()}
    incoming["lm_head.weight"] = incoming["embed.weight"]  # tied: the trainer's state dict has both
    model = Model({name: torch.zeros_like(t) for name, t in incoming.items() if name != "lm_head.weight"})
    w = worker(model)
    for shift in (0, 1, 2):  # watched, then replayed
        again = {name: t + shift for name, t in incoming.items()}
        w.rollflow_expect(fingerprint.of(again.items()))
        w._rollflow_reload(iter(again.items()))
    assert w.rollflow_weights_intact() and w.rollflow_copy_plans() == 1


def test_a_load_that_cannot_be_read_back_consumes_the_expectation_unchecked(tmp_path):
    from safetensors.torch import save_file

    incoming = {name: t for name, t in weights().items() if t.is_floating_point()}
    model = Model({name: torch.zeros_like(t) for name, t in incoming.items()})
    w = worker(model)
    save_file(incoming, tmp_path / "model.safetensors")
    w.rollflow_expect(fingerprint.of(weights(seed=1).items()))  # not what the files hold
    w.rollflow_load_path(str(tmp_path))  # streamed from files: no copies to read back
    assert w._rollflow_expected is None and w.rollflow_weights_intact()
    w._rollflow_reload(iter(incoming.items()))  # the next load is not checked against it
    assert w.rollflow_weights_intact()


class Engine:
    """Records worker calls; its load fails when told to."""

    def __init__(self, fails: bool = False) -> None:
        self.calls: list[tuple[str, object]] = []
        self.fails = fails

    async def rpc(self, method: str, *args):
        self.calls.append((method, args[0]))
        return [True]

    async def load(self) -> None:
        self.calls.append(("load", None))
        if self.fails:
            raise ConnectionError("the transfer broke")


def test_the_expectation_goes_before_the_load_and_is_withdrawn_when_the_load_fails():
    printed = fingerprint.of(weights().items())
    engine = Engine()
    asyncio.run(expecting(engine, printed, engine.load))  # type: ignore[arg-type]
    assert engine.calls == [("rollflow_expect", printed), ("load", None)]
    broken = Engine(fails=True)
    with pytest.raises(ConnectionError):
        asyncio.run(expecting(broken, printed, broken.load))  # type: ignore[arg-type]
    assert broken.calls == [("rollflow_expect", printed), ("load", None), ("rollflow_expect", None)]
    untouched = Engine()
    asyncio.run(expecting(untouched, None, untouched.load))  # type: ignore[arg-type]
    assert untouched.calls == [("load", None)]
