"""What every command's parser shares: an argument parser that exits 2 on bad arguments, the
config arguments (`CONFIG`, `--preset`, `--set`), and those of the commands that run a model."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)


def add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", type=Path, help="TOML config file (optional)")
    parser.add_argument(
        "-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="log at INFO level (vLLM too)"
    )
    parser.add_argument("--preset", help="start from a built-in preset: tiny, default, reasoning")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY.PATH=VALUE",
        help="override one config field, e.g. --set sampling.max_tokens=32 (repeatable)",
    )


def add_model_args(parser: argparse.ArgumentParser) -> None:
    add_config_args(parser)
    parser.add_argument("--model", default=None, help="the model to use (sets model.path), e.g. runs/x/final")
    parser.add_argument(
        "--run", type=Path, default=None, metavar="DIR", help="a training run: its config and its final/ model"
    )
