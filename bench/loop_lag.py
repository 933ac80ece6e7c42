"""Event-loop stalls during a checkpoint and an engine restart, read from the loop-lag metric.

Runs the tiny preset through the command line three times and prints `loop_lag_ms_max` per step:

- `plain`: no periodic checkpoint (the baseline);
- `checkpoints`: a checkpoint after every step (state snapshot, tensors, fsyncs);
- `restart`: the engine process is killed after step 2 and restarted in place (the replacement
  is given the trainer's weights while the other requests keep streaming).

Each row is one run's steps; compare the rows of one invocation (these machines are noisy). Run
it against another checkout with `--src OTHER/src` to compare two versions side by side. Usage:
`bin/dev python bench/loop_lag.py [--steps 8] [--src PATH]`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import machine

from rollflow.testing import engine_processes


def run(out: Path, steps: int, settings: list[str], src: str | None, kill_after: int | None = None) -> list[float]:
    args = [sys.executable, "-m", "rollflow", "train", "--preset", "tiny", "--max-steps", str(steps),
            "--output-dir", str(out), "--set", "observe.sinks=[]"]
    for setting in settings:
        args += ["--set", setting]
    env = {**os.environ, **({"PYTHONPATH": src} if src else {})}
    proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    metrics = out / "metrics.jsonl"
    if kill_after is not None:
        while proc.poll() is None and (not metrics.exists() or len(metrics.read_text().splitlines()) < kill_after):
            time.sleep(0.1)
        engine = next(iter(engine_processes(proc.pid)), None)
        if engine is None:
            raise SystemExit("no engine process found to kill")
        os.kill(engine, 9)
    _, err = proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"run failed ({proc.returncode}):\n{err[-2000:]}")
    return [json.loads(line)["loop_lag_ms_max"] for line in metrics.read_text().splitlines()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--src", default=None, help="the rollflow source folder to measure (default: installed)")
    args = parser.parse_args()
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        rows["plain"] = run(Path(tmp) / "plain", args.steps, ["checkpoint.every=0"], args.src)
        rows["checkpoints"] = run(Path(tmp) / "ckpt", args.steps, ["checkpoint.every=1"], args.src)
        rows["restart"] = run(Path(tmp) / "restart", args.steps, ["checkpoint.every=0"], args.src, kill_after=2)
    print(f"loop_lag_ms_max per step ({args.src or 'installed rollflow'})")
    for name, lags in rows.items():
        print(f"{name:12s} max {max(lags):7.1f}   " + " ".join(f"{v:6.1f}" for v in lags))
    print(machine.describe())
    print(f"RESULT loop_lag_ms_max plain={max(rows['plain']):.1f} checkpoints={max(rows['checkpoints']):.1f} "
          f"restart={max(rows['restart']):.1f}")


if __name__ == "__main__":
    main()
