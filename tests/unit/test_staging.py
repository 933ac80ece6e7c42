"""The `staged` layout's plan: which incoming tensors a stage may write where the model reads
them, which go to spare copies, what the commit changes. A stand-in model (the real engine is
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
