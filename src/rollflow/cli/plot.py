"""`plot DIR...`: PNG charts of finished runs (timeline, reward, staleness, throughput)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

NAME = "plot"
ASYNC = False


def add(commands: Any) -> None:
    parser = commands.add_parser(NAME, help="write PNG charts of finished runs (timeline, reward, staleness)")
    parser.add_argument("runs", nargs="+", type=Path, metavar="DIR", help="output directories of training runs")
    parser.add_argument("--out", type=Path, default=None, help="where the PNGs go (default: the (first) run directory)")


def run(args: argparse.Namespace) -> int:
    from rollflow.plots import plot

    for path in plot(args.runs, args.out):
        print(path)
    return 0
