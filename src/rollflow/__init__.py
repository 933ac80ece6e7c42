"""rollflow: asynchronous RL post-training for language models.

One asyncio controller keeps tokens flowing between a vLLM engine and torch trainer ranks;
every token records the policy version that produced it. This module is the public API.
"""

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
from rollflow.rollout import rollout
from rollflow.sampler import Sampler

__version__ = "0.1.0"

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
    "resolve_model",
    "rollout",
    "train",
]
