"""What a vLLM process needs before it starts, and rollflow's sampling settings in vLLM's terms.

`engine_environment` is the environment any vLLM process rollflow starts reads at import (the
CPU platform and its threads when there is no GPU, quiet logs); `prepare_environment` applies
it to this process for an in-process engine; `sampling_params` turns a `SamplingSpec` into
vLLM's `SamplingParams`. No engine is started here.
"""

from __future__ import annotations

import os
from typing import Any

from rollflow.config import EngineConfig
from rollflow.records import SamplingSpec


def engine_environment(config: EngineConfig) -> dict[str, str]:
    """Environment variables vLLM reads at import, for any vLLM process rollflow starts: the CPU
    platform and its threads when there is no GPU, quiet logs."""
    import torch

    env = {"VLLM_LOGGING_LEVEL": "WARNING"}
    if not torch.cuda.is_available():
        env |= {"VLLM_TARGET_DEVICE": "cpu", "OMP_NUM_THREADS": str(config.threads)}
    return env


def prepare_environment(config: EngineConfig) -> None:
    """Set `engine_environment` for an in-process engine, plus one engine process (the worker
    inside the engine core) instead of two on CPU. Values the user already set win. Must run
    before `vllm` is imported."""
    env = engine_environment(config) | {"VLLM_CONFIGURE_LOGGING": "1"}
    if env.get("VLLM_TARGET_DEVICE") == "cpu":
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    for key, value in env.items():
        os.environ.setdefault(key, value)


def sampling_params(sampling: SamplingSpec, deltas: bool = True) -> Any:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k if sampling.top_k > 0 else -1,
        max_tokens=sampling.max_tokens,
        ignore_eos=sampling.ignore_eos,
        seed=sampling.seed,
        logprobs=0,  # the sampled token's log-prob only
        # FINAL_ONLY spares the client one Python round trip per token when nobody watches.
        output_kind=RequestOutputKind.DELTA if deltas else RequestOutputKind.FINAL_ONLY,
        detokenize=False,
    )
