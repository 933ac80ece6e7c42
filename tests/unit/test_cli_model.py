"""`generate` / `eval` with `--model` or `--run`: which config and model they use, and the errors."""

from __future__ import annotations

import asyncio
import json

import pytest

from rollflow.cli import build_parser
from rollflow.cli.model import model_config
from rollflow.config import dump_config, load_config
from rollflow.errors import UserInputError


def parse(*argv: str):
    return build_parser().parse_args(["eval", *argv])


def finished_run(tmp_path, *overrides: str):
    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    (run / "config.toml").write_text(dump_config(load_config(preset="tiny", overrides=list(overrides))))
    return run


def test_run_takes_its_config_and_its_final_model(tmp_path):
    run = finished_run(tmp_path, "sampling.max_tokens=40")
    (run / "final" / "config.json").write_text("{}")
    config = model_config(parse("--run", str(run)))
    assert config.model.path == str(run / "final") and config.sampling.max_tokens == 40
    other = tmp_path / "other model"
    assert model_config(parse("--run", str(run), "--model", str(other))).model.path == str(other)
    assert model_config(parse("--preset", "tiny", "--model", str(other))).model.path == str(other)


def test_run_errors_name_the_fix(tmp_path):
    run = finished_run(tmp_path)
    with pytest.raises(UserInputError, match="no trained model in .*final .the run did not finish"):
        model_config(parse("--run", str(run)))
    (run / "final" / "adapter_config.json").write_text(json.dumps({"r": 8}))
    with pytest.raises(UserInputError, match=r"its final/ is a LoRA adapter; .*export .* --merged"):
        model_config(parse("--run", str(run)))
    with pytest.raises(UserInputError, match="takes the run's own config.toml"):
        model_config(parse("--run", str(run), "--preset", "tiny"))
    with pytest.raises(UserInputError, match="not a rollflow run directory"):
        model_config(parse("--run", str(tmp_path / "nothing")))


@pytest.mark.parametrize("command", ["generate", "eval"])
def test_a_missing_dataset_file_is_named_before_the_engine_starts(command, monkeypatch, capsys):
    """A user who mistyped a path hears of it at once, not after the engine's 20-40 s start."""
    from rollflow.cli import main
    from rollflow.engine.vllm import VLLMEngine

    async def no_start(self):
        raise AssertionError("the engine started before the prompts were read")

    monkeypatch.setattr(VLLMEngine, "start", no_start)
    policy = asyncio.get_event_loop_policy()  # the command installs uvloop's: not for the tests after
    try:
        code = main([command, "--preset", "tiny", "--set", "data.task=jsonl", "--set", "data.paths=['/no/file.jsonl']"])
    finally:
        asyncio.set_event_loop_policy(policy)
    assert code == 2
    error = capsys.readouterr().err.strip()
    assert error.endswith("/no/file.jsonl: cannot read dataset file (No such file or directory)")
