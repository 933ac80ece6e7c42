"""rollflow: asynchronous RL post-training for language models.

One asyncio controller keeps tokens flowing between a vLLM engine and torch trainer ranks;
every token records the policy version that produced it. This module is the public API.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rollflow.agent import AgentTask
    from rollflow.config import Config, load_config
    from rollflow.controller import Controller, RunResult, train
    from rollflow.engine import Engine, EngineOutput
    from rollflow.envs import Environment, EnvStep, Turn
    from rollflow.errors import (
        CheckpointError,
        ConfigError,
        DataError,
        EngineDeadError,
        EngineError,
        ModelNotFoundError,
        RetryableError,
        RollflowError,
        TrainingError,
        UserInputError,
    )
    from rollflow.ledger import summarize as audit_ledger
    from rollflow.models import resolve_model
    from rollflow.records import Batch, Group, Message, Prompt, Sample, SamplingSpec
    from rollflow.rundir import new_run_dir
    from rollflow.sampler import Sampler

# Imported now (it is light): the function `rollflow.rollout` must not be shadowed by its module.
from rollflow.rollout import rollout

__version__ = "0.1.0"

_EXPORTS = {
    "AgentTask": ("rollflow.agent", "AgentTask"),
    "Batch": ("rollflow.records", "Batch"),
    "CheckpointError": ("rollflow.errors", "CheckpointError"),
    "Config": ("rollflow.config", "Config"),
    "ConfigError": ("rollflow.errors", "ConfigError"),
    "Controller": ("rollflow.controller", "Controller"),
    "DataError": ("rollflow.errors", "DataError"),
    "Engine": ("rollflow.engine", "Engine"),
    "EngineDeadError": ("rollflow.errors", "EngineDeadError"),
    "EngineError": ("rollflow.errors", "EngineError"),
    "EngineOutput": ("rollflow.engine", "EngineOutput"),
    "EnvStep": ("rollflow.envs", "EnvStep"),
    "Environment": ("rollflow.envs", "Environment"),
    "Group": ("rollflow.records", "Group"),
    "Message": ("rollflow.records", "Message"),
    "ModelNotFoundError": ("rollflow.errors", "ModelNotFoundError"),
    "Prompt": ("rollflow.records", "Prompt"),
    "RetryableError": ("rollflow.errors", "RetryableError"),
    "RollflowError": ("rollflow.errors", "RollflowError"),
    "RunResult": ("rollflow.controller", "RunResult"),
    "Sample": ("rollflow.records", "Sample"),
    "Sampler": ("rollflow.sampler", "Sampler"),
    "SamplingSpec": ("rollflow.records", "SamplingSpec"),
    "TrainingError": ("rollflow.errors", "TrainingError"),
    "Turn": ("rollflow.envs", "Turn"),
    "UserInputError": ("rollflow.errors", "UserInputError"),
    "audit_ledger": ("rollflow.ledger", "summarize"),
    "load_config": ("rollflow.config", "load_config"),
    "new_run_dir": ("rollflow.rundir", "new_run_dir"),
    "resolve_model": ("rollflow.models", "resolve_model"),
    "train": ("rollflow.controller", "train"),
}
"""Each public name: the module that defines it and its name there. They are imported on first
use, so `import rollflow` (and the command line's errors) does not wait for torch and vLLM."""


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'rollflow' has no attribute {name!r}")
    module, attribute = _EXPORTS[name]
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = [
    "AgentTask",
    "Batch",
    "CheckpointError",
    "Config",
    "ConfigError",
    "Controller",
    "DataError",
    "Engine",
    "EngineDeadError",
    "EngineError",
    "EngineOutput",
    "EnvStep",
    "Environment",
    "Group",
    "Message",
    "ModelNotFoundError",
    "Prompt",
    "RetryableError",
    "RollflowError",
    "RunResult",
    "Sample",
    "Sampler",
    "SamplingSpec",
    "TrainingError",
    "Turn",
    "UserInputError",
    "__version__",
    "audit_ledger",
    "load_config",
    "new_run_dir",
    "resolve_model",
    "rollout",
    "train",
]
