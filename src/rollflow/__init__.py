"""rollflow: asynchronous RL post-training for language models.

One asyncio controller keeps tokens flowing between a vLLM engine and torch trainer ranks;
every token records the policy version that produced it. This module is the public API.
"""

from rollflow.config import Config, load_config
from rollflow.controller import RunResult, train
from rollflow.engine import Engine, EngineOutput
from rollflow.errors import (
    ConfigError,
    DataError,
    EngineDeadError,
    EngineError,
    ModelNotFoundError,
    RetryableError,
    RollflowError,
    UserInputError,
)
from rollflow.models import resolve_model
from rollflow.records import Batch, Group, Message, Prompt, Sample, SamplingSpec
from rollflow.rollout import rollout
from rollflow.sampler import Sampler

__version__ = "0.1.0"

__all__ = [
    "Batch",
    "Config",
    "ConfigError",
    "DataError",
    "Engine",
    "EngineDeadError",
    "EngineError",
    "EngineOutput",
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
    "UserInputError",
    "__version__",
    "load_config",
    "resolve_model",
    "rollout",
    "train",
]
