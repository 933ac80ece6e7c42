"""A quiet console: third-party warnings that are known to be harmless are not printed.

Each entry of `HARMLESS` is one message from vLLM (or torch inside vLLM's processes) that a normal
run prints, with the reason it does not matter here. Where a warning had a cause rollflow could
remove, it was removed instead (the engine gets token prompts in vLLM's current input form; vLLM's
second shutdown at exit is skipped; the load progress bars are off); what is left is filtered.
Verbose mode (`-v`, i.e. vLLM's log level INFO or DEBUG) shows everything.

The filter reaches vLLM's own processes through `VLLM_LOGGING_CONFIG_PATH`: a logging config
that is vLLM's default plus `Harmless` on its handler, which every vLLM process applies when it
imports vLLM.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import warnings
from pathlib import Path

HARMLESS: list[tuple[str, str, str]] = [
    # (logger name, start of the message (a leading * matches a class name), why it is harmless)
    (
        "vllm.model_executor.model_loader.reload.layerwise",
        "*RotaryEmbedding: Failed to load weights",
        "the rotary layer's only tensor is its cos/sin cache, computed from the model config and "
        "never in a checkpoint; vLLM puts the layer's own cache back (the tests compare tokens and "
        "log-probs after every reload with the trainer's weights)",
    ),
    (
        "vllm.engine.arg_utils",
        "The global random seed is set to",
        "rollflow seeds and checkpoints its own random state after the engine starts",
    ),
    (
        "vllm.engine.arg_utils",
        "This model does not officially support disabling chunked prefill",
        "rollflow turns chunked prefill off on CPU on purpose and gives each step a token budget of "
        "at least the longest context, so every prompt is prefilled whole, as for a model without "
        "chunked prefill (a split prefill of a seeded request kills vLLM's CPU engine core; the "
        "engine tests decode seeded prompts that overfill a step, the same draws twice)",
    ),
    ("vllm.platforms.cpu", "Triton is not installed", "the CPU backend runs without Triton"),
    ("vllm.platforms.cpu", "Reset SSM cache type", "only state-space models have an SSM cache"),
    ("vllm.config.vllm", "Model Runner V2 requires Triton", "the V1 model runner is the CPU path"),
    (
        "vllm.config.vllm",
        "Inductor compilation was disabled",
        "vLLM's CPU backend turns Inductor off itself; nothing rollflow set is ignored",
    ),
    (
        "vllm.v1.worker.cpu_worker",
        "libtcmalloc is not found in LD_PRELOAD",
        "a speed hint about the allocator (docs/install.md)",
    ),
    ("vllm.v1.worker.cpu_worker", "libiomp is not found in LD_PRELOAD", "a speed hint (docs/install.md)"),
    (
        "vllm.compilation.decorators",
        "[backbone] Compiling model again due to a load failure",
        "vLLM's compile cache could not be reused and the model is compiled again, as on a first start",
    ),
    ("torch._library.triton", "Triton not available", "vLLM scans for Triton kernels; there are none on CPU"),
    (
        "vllm.model_executor.models.utils",
        "Attempted to load weight",
        "an engine in a narrower dtype than the trainer's (model.dtype = bfloat16 beside a float32 "
        "trainer) casts each pushed tensor as it loads it, once per tensor and update; the cast is "
        "what model.dtype asks for, and the update's fingerprint is checked in the engine's dtype",
    ),
]

REDUCE_OP = "`torch.distributed.reduce_op` is deprecated"
"""vLLM's kernel dispatcher reads every module attribute once, touching this deprecated alias."""


_PATTERNS = {
    start: re.compile(r"\w*" * start.startswith("*") + re.escape(start.lstrip("*"))) for _, start, _ in HARMLESS
}


class Harmless(logging.Filter):
    """Drops the records listed in `HARMLESS`."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(record.name == name and _PATTERNS[start].match(message) for name, start, _ in HARMLESS)


def verbose() -> bool:
    return os.environ.get("VLLM_LOGGING_LEVEL", "WARNING").upper() in ("INFO", "DEBUG")


def quiet_environment() -> dict[str, str]:
    """Environment variables that quiet the vLLM processes started with them (none when verbose)."""
    if verbose():
        return {}
    python_warnings = ",".join(filter(None, [os.environ.get("PYTHONWARNINGS"), f"ignore:{REDUCE_OP}:FutureWarning"]))
    return {
        "VLLM_LOGGING_CONFIG_PATH": str(logging_config_file()),
        "PYTHONWARNINGS": python_warnings,
        # C++ warnings of torch / vLLM's CPU ops: only "memory bound to NUMA node 0", on start.
        "TORCH_CPP_LOG_LEVEL": "ERROR",
    }


def quiet_this_process() -> None:
    """The same filters in this process, and no progress bars from transformers."""
    if verbose():
        return
    warnings.filterwarnings("ignore", message=re.escape(REDUCE_OP), category=FutureWarning)
    for name in {name for name, _, _ in HARMLESS}:
        logging.getLogger(name).addFilter(Harmless())
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return
    hf_logging.disable_progress_bar()  # "Loading weights", "Writing model shards": a bar per load


def logging_config_file() -> Path:
    """vLLM's default logging config with `Harmless` on its handler, as a file in rollflow's
    cache (named by its content, so every process and every version finds its own)."""
    from rollflow.models.cache import cache_root

    config = {
        "version": 1,
        "disable_existing_loggers": False,
        "filters": {"harmless": {"()": f"{__name__}.Harmless"}},
        "formatters": {
            "vllm": {
                "()": "vllm.logging_utils.NewLineFormatter",
                "datefmt": "%m-%d %H:%M:%S",
                "format": "(%(vllm_process_name)s pid=%(process)d) %(levelname)s %(asctime)s "
                "[%(fileinfo)s:%(lineno)d] %(message)s",
            },
        },
        "handlers": {
            "vllm": {
                "class": "logging.StreamHandler",
                "formatter": "vllm",
                "filters": ["harmless"],
                "level": "WARNING",
                "stream": "ext://sys.stdout",
            },
        },
        "loggers": {
            "vllm": {"handlers": ["vllm"], "level": "WARNING", "propagate": False},
            "torch._library.triton": {"filters": ["harmless"]},
        },
    }
    text = json.dumps(config, indent=1, sort_keys=True)
    path = cache_root() / f"vllm-logging-{hashlib.sha256(text.encode()).hexdigest()[:12]}.json"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(text)
        os.replace(tmp, path)  # whole, also when processes write it at once
    return path
