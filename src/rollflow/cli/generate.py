"""`generate`: sample completions for task prompts from the configured model and score them."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from rollflow.cli.model import counting, model_config, prepared_model, started_engine
from rollflow.cli.parser import add_model_args
from rollflow.errors import UnusablePrompt, UserInputError

NAME = "generate"
ASYNC = True


def add(commands: Any) -> None:
    gen = commands.add_parser(NAME, help="sample completions for task prompts and score them")
    add_model_args(gen)
    gen.add_argument("--prompts", type=int, default=16, help="number of prompts (default 16)")
    gen.add_argument("--greedy", action="store_true", help="greedy decoding, one sample per prompt")


def run(args: argparse.Namespace) -> int:
    return asyncio.run(_generate(args))


async def _generate(args: argparse.Namespace) -> int:
    from rich.console import Console

    from rollflow.checks import check_task
    from rollflow.config import CONTEXT_CAP
    from rollflow.evaluate import evaluate
    from rollflow.models import prompt_encoder
    from rollflow.sampler import Sampler, sampling_spec
    from rollflow.scoring import eval_scorer

    if args.prompts <= 0:
        raise UserInputError(f"--prompts: expected a positive number, got {args.prompts}")
    console = Console(stderr=True)
    config = model_config(args)
    task = check_task(config)
    group = 1 if args.greedy else config.rollout.group_size
    model_path, tokenizer = prepared_model(config, console)
    sampler = Sampler(config.data, prompt_encoder(tokenizer, config.data), task=task)
    prompts = []
    for _ in range(args.prompts):
        try:
            prompts.append(await sampler.draw())
        except UnusablePrompt as err:
            console.print(f"dropped {err}", highlight=False)
    engine = await started_engine(config, model_path, console)
    scorer = eval_scorer(config)
    try:
        with console.status("generating") as status:
            report = await evaluate(
                engine,
                prompts,
                sampling_spec(config, greedy=args.greedy),
                samples_per_prompt=group,
                decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                scorer=scorer,
                on_sample=counting(status, "generating", len(prompts) * group),
                max_model_len=config.engine.max_model_len or CONTEXT_CAP,
            )
    finally:
        await scorer.aclose()
        await engine.aclose()
    for reason, n in report.dropped.items():
        console.print(f"dropped {n} of {len(prompts)} prompts: {reason}", highlight=False)
    for question, text, reward in report.examples:
        console.print(f"[bold]{question}[/bold] -> {text.strip()!r} reward={reward:g}", highlight=False)
    print(
        f"model={config.model.path} task={config.data.task} prompts={report.prompts} samples={report.samples} "
        f"accuracy={report.accuracy:.3f} pass@{group}={report.pass_at_group:.3f} "
        f"tokens={report.tokens} wall_s={report.wall_s:.1f} tokens_per_s={report.tokens_per_s:.0f}"
    )
    return 0
