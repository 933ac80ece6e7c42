"""`export DIR`: a run's trained policy from a checkpoint as a Hugging Face folder."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rollflow.errors import UserInputError

NAME = "export"
ASYNC = True


def add(commands: Any) -> None:
    export = commands.add_parser(NAME, help="write a run's trained policy from a checkpoint as a Hugging Face folder")
    export.add_argument("run", type=Path, metavar="DIR", help="output directory of a training run")
    export.add_argument("--step", type=int, default=None, help="the checkpoint after this step (default: latest)")
    export.add_argument("--out", type=Path, default=None, help="where the folder goes (default DIR/export/step-N)")
    export.add_argument("--merged", action="store_true", help="LoRA runs: the base model with the adapter merged in")


def run(args: argparse.Namespace) -> int:
    from rollflow.export import export_checkpoint

    if args.step is not None and args.step < 0:
        raise UserInputError(f"--step: expected a step count of 0 or more, got {args.step}")
    out = export_checkpoint(args.run, step=args.step, out=args.out, merged=args.merged)
    print(out)
    return 0
