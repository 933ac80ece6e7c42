"""End-to-end training on the tiny preset with real vLLM: staleness bounds, accounting, learning."""

from __future__ import annotations

import json

import pytest

from rollflow.config import load_config
from rollflow.controller import train

pytestmark = pytest.mark.integration


def ledger(path):
    return [json.loads(line) for line in (path / "ledger.jsonl").read_text().splitlines()]


def assert_exactly_once(entries, result):
    ids = [e["id"] for e in entries]
    assert len(ids) == len(set(ids)), "a prompt appears twice in the ledger"
    trained = [e for e in entries if e["outcome"] == "trained"]
    assert len(trained) == result.trained_prompts == result.steps * 4
    assert all(e["reason"].startswith("run ended") for e in entries if e["outcome"] == "dropped")


async def test_async_max_lag_2_never_trains_a_token_older_than_the_bound(tmp_path):
    config = load_config(preset="tiny", overrides=["run.max_lag=2", "run.max_steps=8"])
    result = await train(config, tmp_path)
    assert result.steps == 8
    assert all(m["loss_lag_max"] <= 2 for m in result.metrics)
    assert max(m["lag_max"] for m in result.metrics) >= 1  # it did run ahead of the trainer
    assert_exactly_once(ledger(tmp_path), result)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 8
    for key in ("step", "version", "reward_mean", "reward_std", "samples", "tokens", "lag_mean", "lag_max",
                "withheld_tokens", "unscorable", "ratio_mean", "trainer_idle_frac", "gen_tokens_per_s",
                "weight_sync_s", "wall_s"):
        assert key in json.loads(lines[0]), key
    assert (tmp_path / "config.toml").read_text() == __import__("rollflow.config").config.dump_config(config)


async def test_synchronous_mode_is_on_policy(tmp_path):
    config = load_config(preset="tiny", overrides=["run.max_lag=0", "run.max_steps=5"])
    result = await train(config, tmp_path)
    for m in result.metrics:
        assert m["lag_max"] == 0 and m["withheld_tokens"] == 0
        # Engine and trainer hold the same float32 weights: every importance ratio is 1.
        assert abs(m["ratio_min"] - 1) < 1e-3 and abs(m["ratio_max"] - 1) < 1e-3
    assert_exactly_once(ledger(tmp_path), result)
    assert [e for e in ledger(tmp_path) if e["outcome"] == "dropped"] == []


async def test_tiny_preset_learns_its_reward(tmp_path):
    result = await train(load_config(preset="tiny"), tmp_path)
    rewards = [m["reward_mean"] for m in result.metrics]
    first, last = sum(rewards[:4]) / 4, sum(rewards[-4:]) / 4
    assert last > first + 0.1, rewards


def test_two_trainer_ranks_under_torchrun(tmp_path):
    """torchrun, 2 gloo ranks with FSDP2: rank 0 runs the controller, rank 1 follows; the run is
    on-policy (max_lag 0), so the sharded trainer must agree with the engine token for token."""
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
         "--master-port", str(port), "-m", "rollflow", "train", "--preset", "tiny", "--max-steps", "3",
         "--set", "run.max_lag=0", "--output-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=300, check=False,
        env=dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo"),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [0, 1, 2]
    for m in metrics:
        assert m["lag_max"] == 0
        assert abs(m["ratio_min"] - 1) < 1e-3 and abs(m["ratio_max"] - 1) < 1e-3
    entries = ledger(tmp_path)
    assert len([e for e in entries if e["outcome"] == "trained"]) == 12
    assert "steps=3" in done.stdout
