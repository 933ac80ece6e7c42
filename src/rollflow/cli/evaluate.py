"""`eval`: greedy accuracy (and pass@k) of a model on held-out task prompts, as JSON. With a config
whose samples are episodes (`[env]`), each prompt is played as an episode of its source and scored
as training scores it (the environment's reward, plus the run's reward functions): from the
source's own prompts, the last `--prompts` of them (those a run with `run.eval_prompts` = that
number holds out), else from `data.task`'s held-out prompts."""

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
    from rollflow.models import check_chat_template

    if args.prompts <= 0:
        raise UserInputError(f"--prompts: expected a positive number, got {args.prompts}")
    if args.pass_k < 0:
        raise UserInputError(f"--pass-k: expected 0 or more samples per prompt, got {args.pass_k}")
    console = Console(stderr=True)
    config = model_config(args)
    plan = None
    if config.env is None:
        check_task(config)
    else:
        from rollflow.controller.setup import prepare

        plan = prepare(config)  # the task checked, the source of episodes and the run's rewards
    episodes = None
    try:
        if plan is not None and plan.episodes is not None:
            await plan.episodes.start()  # before the model: a bad address fails in seconds
        model_path, tokenizer = prepared_model(config, console)
        if plan is not None and plan.episodes is not None:
            if plan.episodes.renders_chat:
                check_chat_template(tokenizer, config.model.path, "environments render conversations with it")
            episodes = held_out_episodes(plan.episodes, config, tokenizer, model_path, args.prompts)
        prompts = await held_out_prompts(config, tokenizer, args.prompts, episodes.rows if episodes else None)
        engine = await started_engine(config, model_path, console)
        try:
            with console.status("evaluating") as status:
                progress = counting(status, "evaluating", len(prompts) * (1 + args.pass_k))
                report = await held_out_report(engine, config, tokenizer, prompts, args.pass_k, on_sample=progress,
                                               episodes=episodes, scorer=plan.scorer if plan else None)  # fmt: skip
        finally:
            await engine.aclose()
    finally:
        if plan is not None:
            await plan.scorer.aclose()
            await plan.eval_scorer.aclose()
            if plan.episodes is not None:
                await plan.episodes.aclose()
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


def held_out_episodes(source: Any, config: Any, tokenizer: Any, model_path: Path, n: int) -> Any:
    """How `eval` plays its prompts as episodes of `source`: from the source's last `n` rows, if it
    brings its own prompts."""
    from rollflow.engine.environment import resolve_context
    from rollflow.envs import ChatFormat
    from rollflow.episodes import EpisodeContext
    from rollflow.evaluate import HeldOutEpisodes
    from rollflow.sampler import sampling_spec

    rows = source.rows()
    context = EpisodeContext(
        chat=ChatFormat(tokenizer),
        sampling=sampling_spec(config),
        max_model_len=resolve_context(config.engine, model_path).max_model_len,
    )
    return HeldOutEpisodes(source, context, rows[-n:] if rows is not None else None)
