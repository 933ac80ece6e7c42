"""`eval`: greedy accuracy (and pass@k) of a model on held-out task prompts, as JSON."""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from typing import Any

from rollflow.cli.model import counting, model_config, prepared_model, started_engine
from rollflow.cli.parser import add_model_args
from rollflow.errors import UserInputError

NAME = "eval"
ASYNC = True


def add(commands: Any) -> None:
    ev = commands.add_parser(NAME, help="greedy accuracy (and pass@k) of a model on held-out task prompts, as JSON")
    add_model_args(ev)
    ev.add_argument("--prompts", type=int, default=64, help="number of held-out prompts (default 64)")
    ev.add_argument("--pass-k", type=int, default=0, metavar="K", help="also sample K per prompt for pass@K")
    ev.add_argument("--out", type=Path, default=None, help="write the JSON here too (default: print only)")


def run(args: argparse.Namespace) -> int:
    return asyncio.run(_eval(args))


async def _eval(args: argparse.Namespace) -> int:
    from rich.console import Console

    from rollflow.checks import check_task
    from rollflow.evaluate import held_out_prompts, held_out_report

    if args.prompts <= 0:
        raise UserInputError(f"--prompts: expected a positive number, got {args.prompts}")
    if args.pass_k < 0:
        raise UserInputError(f"--pass-k: expected 0 or more samples per prompt, got {args.pass_k}")
    console = Console(stderr=True)
    config = model_config(args)
    check_task(config)
    model_path, tokenizer = prepared_model(config, console)
    prompts = await held_out_prompts(config, tokenizer, args.prompts)
    engine = await started_engine(config, model_path, console)
    try:
        with console.status("evaluating") as status:
            progress = counting(status, "evaluating", args.prompts * (1 + args.pass_k))
            report = await held_out_report(engine, config, tokenizer, prompts, args.pass_k, on_sample=progress)
    finally:
        await engine.aclose()
    if report.get("dropped"):
        reasons = "; ".join(f"{reason} ×{n}" for reason, n in report["dropped_reasons"].items())
        said = f"{report['dropped']} of {len(prompts)} held-out prompts were dropped: {reasons}"
        console.print(said, highlight=False)
    text = json.dumps(report)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(text)
    return 0
