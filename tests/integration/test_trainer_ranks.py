"""Two gloo ranks with FSDP2 take the same step as one rank on the same batch."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import msgspec
import pytest
import torch

from rollflow.config import LoRAConfig, TrainerConfig
from rollflow.models import tiny_model_path
from rollflow.trainer import Trainer

pytestmark = pytest.mark.integration



@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_two_fsdp2_ranks_equal_one_rank(tmp_path, lora, make_batch, close, torchrun):
    config = TrainerConfig(lr=1e-3, micro_batch_tokens=40, lora=LoRAConfig(enabled=lora, rank=4))
    single = Trainer(tiny_model_path(0), config)
    batch = make_batch(single, n=7)
    (tmp_path / "batch.msgpack").write_bytes(msgspec.msgpack.encode(batch))
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    done = subprocess.run(
        [*torchrun, str(Path(__file__).parent / "rank_worker.py"),
         str(tmp_path / "batch.msgpack"), str(tmp_path), "1" if lora else "0"],
        capture_output=True, text=True, timeout=300, env=env, check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = torch.load(tmp_path / "result.pt")
    metrics = json.loads((tmp_path / "metrics.json").read_text())

    single.accumulate(batch)
    grads = single.gradients()
    single.optimizer.zero_grad(set_to_none=True)
    want_metrics = single.step(batch)
    weights = dict(single.full_weights())

    assert grads.keys() == result["grads"].keys() and grads
    # FSDP2 reduce-scatters gradients across ranks: every element is summed in another order
    # than on one rank, so compare against each tensor's scale, not element by element.
    for name, g in grads.items():
        close(result["grads"][name], g, rel=1e-4, name=name)
    assert weights.keys() == result["weights"].keys()
    # Adam's first step moves every weight by about lr · sign(g), so a gradient within float noise
    # of zero can land a few elements up to a fraction of lr apart; everything else agrees to 1e-5.
    for name, w in weights.items():
        diff = (result["weights"][name] - w).abs()
        assert diff.max() <= 0.1 * config.lr, name
        assert (diff > 1e-5).float().mean() <= 1e-4, name
    for key in ("loss", "tokens", "ratio_mean", "entropy", "grad_norm"):
        assert metrics[key] == pytest.approx(want_metrics[key], rel=1e-4, abs=1e-6), key


def test_fsdp2_ranks_save_and_restore_a_checkpoint(tmp_path, make_batch, torchrun):
    """Each rank writes its shard with torch.distributed.checkpoint; a fresh trainer on every rank
    loads them and takes the same next step as the original, to the bit."""
    config = TrainerConfig(lr=1e-3, micro_batch_tokens=40)
    batch = make_batch(Trainer(tiny_model_path(0), config), n=7)
    (tmp_path / "batch.msgpack").write_bytes(msgspec.msgpack.encode(batch))
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    done = subprocess.run(
        [*torchrun, str(Path(__file__).parent / "rank_worker.py"),
         str(tmp_path / "batch.msgpack"), str(tmp_path), "0", "checkpoint"],
        capture_output=True, text=True, timeout=300, env=env, check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "checkpoint.json").read_text())
    assert result == {"max_diff": 0.0, "steps": 2}
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    # The shards read back in one process (what `rollflow export` does) are the weights saved.
    from rollflow.config import Config
    from rollflow.export import load_policy

    lm = load_policy(tmp_path / "checkpoint", tiny_model_path(0), Config(trainer=config))
    saved = torch.load(tmp_path / "saved.pt")
    assert lm.state_dict().keys() == saved.keys()
    assert all(torch.equal(lm.state_dict()[k], saved[k]) for k in saved)
