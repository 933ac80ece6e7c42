"""`ledger DIR`: audit a run's prompt accounting (trained, dropped by reason, duplicates and
missing); exit 1 if anything is wrong."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

NAME = "ledger"
ASYNC = False


def add(commands: Any) -> None:
    parser = commands.add_parser(
        NAME, help="audit a run's ledger: trained, dropped by reason, duplicates and missing (exit 1 if any)"
    )
    parser.add_argument("run", type=Path, metavar="DIR", help="output directory of a training run")


def run(args: argparse.Namespace) -> int:
    from rollflow.ledger import summarize

    summary = summarize(args.run)
    print(summary.format())
    return 0 if summary.ok else 1
