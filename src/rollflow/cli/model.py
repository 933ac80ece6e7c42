"""What the commands that run a model share (`generate`, `eval`): the config of a run or of the
given settings with `--model`, a started engine with its tokenizer, and a progress count."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rollflow.errors import UserInputError


def model_config(args: argparse.Namespace) -> Any:  # -> Config
    """The config for `generate` / `eval`: a run's (`--run`) or the given one, with `--model`."""
    from rollflow.config import load_config

    config_file, overrides = args.config, list(args.overrides)
    model = args.model
    if args.run is not None:
        if config_file is not None or args.preset:
            raise UserInputError("--run: takes the run's own config.toml; give no CONFIG or --preset with it")
        config_file = args.run / "config.toml"
        if not config_file.is_file():
            raise UserInputError(f"--run {args.run}: not a rollflow run directory (no config.toml)")
        from rollflow.export import FINAL  # (imports torch: only here)

        final = args.run / FINAL
        if model is None:
            if (final / "adapter_config.json").is_file():
                raise UserInputError(
                    f"--run {args.run}: its final/ is a LoRA adapter; write a merged model with "
                    f"`python -m rollflow export {args.run} --merged` and pass it as --model"
                )
            if not (final / "config.json").is_file():
                raise UserInputError(f"--run {args.run}: no trained model in {final} (the run did not finish)")
            model = str(final)
    if model is not None:
        overrides.append(f"model.path={json.dumps(str(model))}")
    config = load_config(config_file, preset=args.preset, overrides=overrides)
    if config.env is not None and args.command != "eval":  # single-turn prompts would be another task
        raise UserInputError(
            f"{args.command}: the config's samples are episodes ([env] kind = {config.env.__struct_config__.tag!r}); "
            f"{args.command} samples "
            f"single-turn prompts of data.task ({config.data.task!r}) and would score a task the run does not train "
            "on. Leave [env] out to use it on the task alone, or use eval, which plays the episodes"
        )
    return config


def prepared_model(config: Any, console: Any) -> tuple[Path, Any]:
    """The config's model, ready for an engine (converted once if it must be), and its tokenizer."""
    from rollflow.models import load_tokenizer, resolve_model

    with console.status(f"preparing model {config.model.path}"):
        model_path = resolve_model(config.model.path)
        return model_path, load_tokenizer(model_path)


async def started_engine(config: Any, model_path: Path, console: Any) -> Any:
    """A started vLLM engine for `model_path` (from `prepared_model`). The commands read their
    prompts first, so a bad dataset is named at once, not after the engine's 20-40 s start."""
    from rollflow.engine.vllm import VLLMEngine

    engine = VLLMEngine(model_path, config.engine, dtype=config.model.dtype)
    with console.status("starting vLLM engine (20-40 s on CPU)"):
        await engine.start()
    return engine


def counting(status: Any, what: str, total: int) -> Callable[[object], None]:
    """A per-sample callback that shows `what n/total samples` on the console's status line."""
    done = 0
    status.update(f"{what} 0/{total} samples")

    def progress(_sample: object) -> None:
        nonlocal done
        done += 1
        status.update(f"{what} {done}/{total} samples")

    return progress
