"""`simulate`: predicted throughput, idle time and staleness for a GPU setup, in virtual time
(the simulator itself is `rollflow.sim`)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

NAME = "simulate"
ASYNC = False


def add(commands: Any) -> None:
    sim = commands.add_parser(
        NAME, help="predict throughput, idle time and staleness for a GPU setup (virtual time, seconds)"
    )
    sim.add_argument("--model-size", default="7B", choices=["7B", "32B"], help="timing profile (default 7B)")
    sim.add_argument("--gpu", default="H100", choices=["H100", "H200"], help="GPU type (default H100)")
    sim.add_argument("--inference-gpus", type=int, default=1, help="engine replicas, one GPU each (default 1)")
    sim.add_argument("--trainer-gpus", type=int, default=1, help="data-parallel trainer GPUs (default 1)")
    sim.add_argument("--max-lag", type=int, default=1, help="staleness bound (default 1)")
    sim.add_argument("--partial", default="keep", choices=["keep", "resume", "restart"], help="partial rollout mode")
    sim.add_argument(
        "--lengths",
        default=None,
        metavar="lognormal:MEAN,SIGMA|FILE",
        help="completion lengths: a lognormal, a run's ledger.jsonl or trace.json, or a file of lengths "
        "(default lognormal:300,0.8, or a --profile's own)",
    )
    sim.add_argument(
        "--profile",
        type=Path,
        metavar="FILE",
        help="engine and trainer profiles measured on a machine (bench/simulator_validation.py --save-profile) "
        "instead of --model-size/--gpu's planning numbers",
    )
    sim.add_argument(
        "--sync-gb-per-s",
        type=float,
        metavar="GBPS",
        help="bandwidth of the weight sync to the engines, GB/s (default: the profile's; 25 for the planning ones)",
    )
    sim.add_argument(
        "--delta-fraction",
        type=float,
        metavar="F",
        help="engines elsewhere sent only the changed elements: each update after the first moves this share "
        "of the bytes, from a staged copy (bench/weight_sync.py's delta_bytes_frac; default 1, every byte)",
    )
    sim.add_argument("--rho", type=float, default=0.5, help="within-group correlation of log-lengths (default 0.5)")
    sim.add_argument("--steps", type=int, default=30, help="optimizer steps (default 30)")
    sim.add_argument("--groups", type=int, default=32, help="groups per step (default 32)")
    sim.add_argument("--group-size", type=int, default=8, help="samples per group (default 8)")
    sim.add_argument("--prompt-tokens", type=int, default=256, help="prompt length in tokens (default 256)")
    sim.add_argument("--max-tokens", type=int, default=1024, help="completion budget (default 1024)")
    sim.add_argument("--sweep", metavar="NAME=V1,V2,...", help="vary one parameter, e.g. inference-gpus=1,2,4,8")
    sim.add_argument("--plot", type=Path, metavar="PNG", help="with --sweep: chart steps/hour and idle time")
    sim.add_argument("--output-dir", type=Path, help="keep the simulated run's files (metrics, ledger, trace)")


def run(args: argparse.Namespace) -> int:
    from rollflow.sim.cli import run_simulate

    return run_simulate(args)
