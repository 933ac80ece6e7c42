"""Known-harmless third-party warnings are filtered, others are not, and `-v` shows them all."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from rollflow.engine.quiet import HARMLESS, Harmless, quiet_environment


def record(name: str, message: str, *args: object) -> logging.LogRecord:
    return logging.LogRecord(name, logging.WARNING, __file__, 1, message, args, None)


def test_the_listed_warnings_are_dropped_and_anything_else_passes():
    harmless = Harmless()
    for name, start, why in HARMLESS:
        assert why and not harmless.filter(record(name, start.replace("*", "") + " (details)"))
    rotary = HARMLESS[0]
    assert not harmless.filter(record(rotary[0], "%s: Failed to load weights", "RotaryEmbedding"))
    assert not harmless.filter(record(rotary[0], "%s: Failed to load weights", "Llama3RotaryEmbedding"))
    assert harmless.filter(record(rotary[0], "%s: Failed to load weights", "LlamaAttention"))  # a real failure
    assert harmless.filter(record("vllm.other", "RotaryEmbedding: Failed to load weights"))  # from elsewhere


def test_vllm_processes_get_the_filter_unless_verbose(monkeypatch):
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "WARNING")
    env = quiet_environment()
    config = json.loads(Path(env["VLLM_LOGGING_CONFIG_PATH"]).read_text())
    assert config["handlers"]["vllm"]["filters"] == ["harmless"]
    assert config["filters"]["harmless"]["()"] == "rollflow.engine.quiet.Harmless"
    assert "FutureWarning" in env["PYTHONWARNINGS"]
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "INFO")  # what -v sets
    assert quiet_environment() == {}


@pytest.mark.parametrize("level", ["DEBUG", "info"])
def test_verbose_levels_are_recognised(monkeypatch, level):
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", level)
    assert quiet_environment() == {}
