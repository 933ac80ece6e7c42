"""Changed-elements weight updates (`rollflow.weight_sync.delta`): the receiver's buffers end
bit-identical to the sender's staged copy, each tensor in its smallest form."""

from __future__ import annotations

import contextlib

import pytest
import torch

from rollflow.weight_sync import delta
from rollflow.weight_sync.buckets import bucket_starts, pack_into, plan_buckets


def packed(weights: dict[str, torch.Tensor], bucket_bytes: int = 4096):
    plan = plan_buckets([(n, t.dtype, tuple(t.shape)) for n, t in weights.items()], bucket_bytes)
    memory = torch.zeros(plan.total_bytes, dtype=torch.uint8)
    pack_into(plan, weights.items(), memory)
    return plan, memory


def buckets_of(plan, memory: torch.Tensor) -> list[torch.Tensor]:
    return [memory[at : at + size].clone() for at, size in zip(bucket_starts(plan), plan.bucket_sizes, strict=True)]


def test_each_tensor_travels_in_its_smallest_form_and_arrives_bit_identical():
    g = torch.Generator().manual_seed(0)
    base = {
        "same": torch.randn(64, 8, generator=g).bfloat16(),
        "few": torch.randn(256, 16, generator=g).bfloat16(),
        "some": torch.randn(64, 64, generator=g).bfloat16(),
        "all": torch.randn(32, 8, generator=g),
        "signs": torch.zeros(16),
    }
    new = {name: t.clone() for name, t in base.items()}
    new["few"].view(-1)[[3, 999, 4000]] += 1  # 3 of 4096: indices
    mask = torch.rand(64, 64, generator=g) < 0.2  # a fifth: a bitmap and the values
    new["some"][mask] = new["some"][mask] * 2
    new["all"] += 1e-3  # every one: the whole tensor
    new["signs"][5] = -0.0  # equal as numbers, not as bits
    new["signs"][6] = float("nan")
    plan, before = packed(base)
    _, after = packed(new)
    modes, payload = delta.encode(plan, after, before)
    # signs: 2 of 16 changed, 10 bytes as a bitmap and the values, 16 as indices and the values
    assert modes[::2] == [delta.SAME, delta.INDICES, delta.BITMAP, delta.WHOLE, delta.BITMAP]
    assert modes[1::2] == [0, 3, int(mask.sum()), 256, 2]
    assert payload.numel() < after.numel() / 2
    buffers = buckets_of(plan, before)
    delta.apply(plan, buffers, modes, payload)
    assert torch.equal(torch.cat(buffers), after)


def test_a_payload_that_does_not_fit_its_modes_is_refused():
    plan, before = packed({"w": torch.zeros(100)})
    _, after = packed({"w": torch.ones(100)})
    modes, payload = delta.encode(plan, after, before)
    with pytest.raises(ValueError, match="short of what its modes need"):
        delta.apply(plan, buckets_of(plan, before), modes, payload[:-1])
    with pytest.raises(ValueError, match="bytes its modes do not use"):
        delta.apply(plan, buckets_of(plan, before), modes, torch.cat([payload, payload[:1]]))
    with pytest.raises(ValueError, match="a delta for 2 tensors, the plan has 1"):
        delta.apply(plan, buckets_of(plan, before), modes * 2, payload)


def test_over_a_gloo_group_the_second_sync_carries_the_changes_and_a_receiver_without_a_base_refuses_them():
    import threading

    from rollflow.weight_sync.gloo import GlooSender, join, receive_buckets

    weights = {"a": torch.randn(512, 8), "b": torch.randn(64)}
    plan, first = packed(weights, bucket_bytes=1 << 20)
    weights["a"][7, 3] = 0.5
    _, second = packed(weights, bucket_bytes=1 << 20)
    sender = GlooSender(timeout_s=20)
    got: dict[str, object] = {}

    def receive() -> None:
        group = join("127.0.0.1", sender.port, 1, 20.0)
        buffers: list[torch.Tensor] = []
        for _ in range(3):
            _, views = receive_buckets(group, buffers)
            list(views)
        got["buffers"] = torch.cat(buffers)
        try:
            receive_buckets(group, [])  # a receiver that holds nothing
        except RuntimeError as err:
            got["refused"] = str(err)

    thread = threading.Thread(target=receive)
    thread.start()
    try:
        sender.connect()
        assert sender.send_packed(plan, first, changes=True) == plan.total_bytes
        assert sender.send_packed(plan, second, changes=True) < 64  # one index, one value, the header
        assert sender.send_packed(plan, second, changes=True) == 40  # nothing changed: the header alone
        with contextlib.suppress(RuntimeError):  # the receiver may hang up before this is sent
            sender.send_packed(plan, first, changes=True)
    finally:
        thread.join(timeout=30)
        sender.close()
    assert torch.equal(got["buffers"], second)
    assert "holds no earlier weights" in str(got["refused"])
