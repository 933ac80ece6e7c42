"""`report DIR`: a summary table of a finished run."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

NAME = "report"
ASYNC = False


def add(commands: Any) -> None:
    parser = commands.add_parser(NAME, help="print a summary table of a finished run")
    parser.add_argument("run", type=Path, metavar="DIR", help="output directory of a training run")


def run(args: argparse.Namespace) -> int:
    from rollflow.plots import report

    print(report(args.run))
    return 0
