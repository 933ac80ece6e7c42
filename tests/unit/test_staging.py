"""The `staged` layout's plan: which incoming tensors a stage may write where the model reads
them, which go to spare copies, what the commit changes; the `Stager` that runs a stage on a
thread and refuses loads after one that was not committed. A stand-in model (the real engine is
tested in tests/integration/test_weight_sync.py and test_update_failure.py)."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from rollflow.engine import staging


class StandIn(nn.Module):
    """An embedding that is also the LM head, a linear layer, a norm and a linear layer with no
    packed copy. `cpu_linear` is what vLLM's CPU dispatch would attach."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Parameter(torch.randn(8, 4), requires_grad=False)
        self.proj = nn.Linear(4, 4, bias=False).requires_grad_(False)
        self.norm = nn.Parameter(torch.ones(4), requires_grad=False)
        self.plain = nn.Linear(4, 4, bias=False).requires_grad_(False)
        self.head = nn.Module()
        self.head.weight = self.embed
        for layer in (self.proj, self.head):
            layer.cpu_linear = packed_linear(layer.weight)
        self.plain.cpu_linear = lambda x, weight, bias: nn.functional.linear(x, weight, bias)


def packed_linear(weight: torch.Tensor):
    packed = weight.clone()  # a copy of its own, as oneDNN's handler holds
    return lambda x, weight, bias: x @ packed.T


def dispatch(layer, remove_weight: bool) -> None:
    layer.cpu_linear = packed_linear(layer.weight)


@pytest.fixture
def model(monkeypatch) -> StandIn:
    m = StandIn()
    monkeypatch.setattr(staging, "_linear", lambda layer: layer is m.proj)
    return m


def test_only_layers_with_a_packed_copy_of_their_own_are_packed(model):
    assert staging.holds_packed_copy(model.proj) and staging.holds_packed_copy(model.head)
    assert not staging.holds_packed_copy(model.plain)  # torch's linear reads the weight live
    view = model.proj.weight[:2]
    model.proj.cpu_linear = lambda x, weight, bias: x @ view.T  # a view of the weight: read live
    assert not staging.holds_packed_copy(model.proj)


def test_a_stage_writes_only_what_no_model_step_reads_and_the_commit_makes_it_live(model):
    new = {
        "proj.a": torch.randn(2, 4),
        "proj.b": torch.randn(2, 4),
        "embed": torch.randn(8, 4),
        "norm": torch.full((4,), 3.0),
        "plain": torch.randn(4, 4),
    }
    targets = [
        [model.proj.weight[:2]],
        [model.proj.weight[2:]],
        [model.embed],
        [model.norm],
        [model.plain.weight],
    ]
    plan = staging.plan_stage(model, targets)
    assert plan is not None and plan.covers_all
    assert {id(layer) for layer, _ in plan.layers} == {id(model.proj), id(model.head)}
    before = {name: t.clone() for name, t in model.named_parameters()}
    x = torch.randn(3, 4)
    old_proj, old_head = model.proj.cpu_linear(x, None, None), model.head.cpu_linear(x, None, None)

    staged = plan.stage(list(new.items()), dispatch, threading.Event())
    # The linear layer's plain weight took the new values; its packed copy did not.
    assert torch.equal(model.proj.weight, torch.cat([new["proj.a"], new["proj.b"]]))
    assert torch.equal(model.proj.cpu_linear(x, None, None), old_proj)
    # What a model step reads is untouched: the embedding (also the head), the norm, the plain layer.
    for name in ("embed", "norm", "plain.weight"):
        assert torch.equal(dict(model.named_parameters())[name], before[name]), name
    assert torch.equal(model.head.cpu_linear(x, None, None), old_head)

    staged.commit()
    assert torch.equal(model.embed, new["embed"]) and torch.equal(model.norm, new["norm"])
    assert torch.equal(model.plain.weight, new["plain"])
    assert torch.equal(model.proj.cpu_linear(x, None, None), x @ model.proj.weight.T)
    assert torch.equal(model.head.cpu_linear(x, None, None), x @ new["embed"].T)


def test_a_load_that_leaves_part_of_a_linear_weight_does_not_cover_all(model):
    plan = staging.plan_stage(model, [[model.proj.weight[:2]], [model.embed]])
    assert plan is not None and not plan.covers_all
    # Only the layers it writes are packed again.
    assert {id(layer) for layer, _ in plan.layers} == {id(model.proj), id(model.head)}
    plan = staging.plan_stage(model, [[model.norm]])
    assert plan is not None and plan.layers == []


def test_a_target_outside_the_model_is_not_staged(model):
    assert staging.plan_stage(model, [[torch.zeros(4)]]) is None


def test_a_stopped_stage_raises_and_changes_nothing_live(model):
    plan = staging.plan_stage(model, [[model.embed], [model.proj.weight]])
    assert plan is not None
    stop = threading.Event()
    stop.set()
    embed = model.embed.clone()
    with pytest.raises(staging.Cancelled):
        plan.stage([("embed", torch.randn(8, 4)), ("proj", torch.randn(4, 4))], dispatch, stop)
    assert torch.equal(model.embed, embed)


def new_weights() -> list[tuple[str, torch.Tensor]]:
    return [("embed", torch.randn(8, 4)), ("proj", torch.randn(4, 4))]


@pytest.fixture
def stager(model) -> staging.Stager:
    copies = {
        "whole": [[model.embed], [model.proj.weight]],
        "part": [[model.proj.weight[:2]]],
        "norm": [[model.norm]],
    }
    return staging.Stager(model, copies, dispatch)


def test_the_stager_stages_on_a_thread_and_the_commit_makes_it_live(model, stager):
    items = new_weights()
    assert stager.start(lambda: ("whole", items)).result(timeout=30) is True
    assert not torch.equal(model.embed, items[0][1])  # staged, not live
    staged = stager.take()
    staged.commit()
    stager.loaded()
    assert torch.equal(model.embed, items[0][1])
    x = torch.randn(3, 4)
    assert torch.equal(model.proj.cpu_linear(x, None, None), x @ items[1][1].T)
    with pytest.raises(RuntimeError, match="nothing is staged"):
        stager.take()


def test_the_stager_answers_false_for_a_load_it_has_no_plan_for(stager):
    assert stager.start(lambda: ("never watched", new_weights())).result(timeout=30) is False
    with pytest.raises(RuntimeError, match="nothing is staged"):
        stager.take()


def test_a_stopped_stager_drops_what_it_staged(stager):
    assert stager.start(lambda: ("whole", new_weights())).result(timeout=30) is True
    stager.stop()  # a whole load comes next: this stage must not be committed after it
    with pytest.raises(RuntimeError, match="nothing is staged"):
        stager.take()


def test_after_a_stage_that_failed_only_loads_rewriting_its_plain_weights_may_follow(model, stager):
    # The stage writes the linear layer's plain weight, then fails on the embedding's spare.
    failing = [("embed", torch.randn(3, 3)), ("proj", torch.randn(4, 4))]
    stager.copies["whole"] = [[model.proj.weight], [model.embed]]
    with pytest.raises(RuntimeError):
        stager.start(lambda: ("whole", failing[::-1])).result(timeout=30)
    assert stager.dirty == "whole"
    assert not stager.refuses("whole")  # the same load, made whole, rewrites what it wrote
    assert stager.refuses("part")  # would leave half of that weight out of step with its packed copy
    assert stager.refuses("norm")  # writes no linear weight at all: refused too
    assert stager.refuses("never watched")  # no plan: what it writes is not known
    # A stage of a refused load answers False and writes nothing.
    proj = model.proj.weight.clone()
    assert stager.start(lambda: ("part", [("proj", torch.randn(2, 4))])).result(timeout=30) is False
    assert torch.equal(model.proj.weight, proj)
    stager.loaded()  # a whole load rewrote them
    assert not stager.refuses("part")
