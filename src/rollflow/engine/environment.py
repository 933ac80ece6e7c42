"""What a vLLM process needs before it starts, and rollflow's sampling settings in vLLM's terms.

`engine_environment` is the environment any vLLM process rollflow starts reads at import (the
CPU platform and its threads when there is no GPU, quiet logs); `prepare_environment` applies
it to this process for an in-process engine; `engine_args` builds its engine arguments;
`serve_command` / `serve_environment` start a vLLM server a `RemoteEngine` drives;
`sampling_params` turns a `SamplingSpec` into
vLLM's `SamplingParams`; `shut_down` ends an in-process engine's processes (once). No engine is
started here.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

import msgspec

from rollflow.config import CONTEXT_CAP, EngineConfig
from rollflow.errors import ConfigError, EngineError
from rollflow.records import SamplingSpec
from rollflow.scratch import scratch_dir

WORKER_EXTENSION = "rollflow.engine.worker.WorkerExtension"
"""The class vLLM mixes into its worker (it must be importable in the spawned processes)."""


def engine_environment(config: EngineConfig) -> dict[str, str]:
    """Environment variables vLLM reads at import, for any vLLM process rollflow starts: the CPU
    platform and its threads when there is no GPU, quiet logs (`rollflow.engine.quiet`).

    On CPU also vLLM's older compile cache instead of its AOT artifacts: vLLM 0.32's CPU build
    saves an AOT artifact at every start that it cannot load at the next ("'function' object has
    no attribute 'finalize_loading'"), so each start traced the model again after a failed load;
    without it a tiny model's engine starts about 8 s sooner on 2 cores."""
    import torch

    from rollflow.engine.quiet import quiet_environment

    env = {"VLLM_LOGGING_LEVEL": "WARNING"} | quiet_environment()
    if not torch.cuda.is_available():
        env |= {"VLLM_TARGET_DEVICE": "cpu", "OMP_NUM_THREADS": str(config.threads), "VLLM_USE_AOT_COMPILE": "0"}
    return env | {LINEAR_LAYOUT: config.linear_layout}


LINEAR_LAYOUT = "ROLLFLOW_LINEAR_LAYOUT"
"""Carries `engine.linear_layout` to the engine's processes (`rollflow.engine.worker` reads it)."""


def prepare_environment(config: EngineConfig) -> None:
    """Set `engine_environment` for an in-process engine, plus one engine process (the worker
    inside the engine core) instead of two on CPU. Values the user already set win. Must run
    before `vllm` is imported."""
    env = engine_environment(config) | {"VLLM_CONFIGURE_LOGGING": "1"}
    if env.get("VLLM_TARGET_DEVICE") == "cpu":
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    for key, value in env.items():
        os.environ.setdefault(key, value)
    os.environ[LINEAR_LAYOUT] = env[LINEAR_LAYOUT]  # this engine's setting, not an earlier one's
    if "VLLM_RPC_BASE_PATH" not in os.environ:
        os.environ["VLLM_RPC_BASE_PATH"] = socket_folder()


def socket_folder() -> str:
    """A folder of this process for the engines' IPC sockets (vLLM leaves one socket file per
    engine in the temp directory otherwise), removed when the process exits (`scratch_dir`)."""
    path = scratch_dir("ipc")
    if len(str(path)) > MAX_SOCKET_FOLDER:  # a socket path (folder + 37) must fit 107 bytes
        path.rmdir()
        path = scratch_dir("ipc", parent="/tmp")
    return str(path)


MAX_SOCKET_FOLDER = 64
"""Longest folder for IPC sockets: vLLM adds a 37-character name, and a Unix socket's whole path
must fit in 107 bytes."""


def model_context(model_path: str | Path) -> int | None:
    """The longest sequence a model's config.json allows, or None if it does not say."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    config = config.get("text_config", config)
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        if isinstance(config.get(key), int) and config[key] > 0:
            return int(config[key])
    return None


def resolve_context(config: EngineConfig, model_path: str | Path) -> EngineConfig:
    """`engine.max_model_len = 0` made concrete: the model's own limit, at most `CONTEXT_CAP`."""
    if config.max_model_len:
        return config
    limit = model_context(model_path)
    return msgspec.structs.replace(config, max_model_len=min(limit, CONTEXT_CAP) if limit else CONTEXT_CAP)


def kv_bytes_per_token(model_path: str | Path, dtype: str) -> int:
    """Bytes of KV cache one token takes in the model (keys and values of every layer)."""
    config = json.loads((Path(model_path) / "config.json").read_text())
    config = config.get("text_config", config)
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    kv_heads = config.get("num_key_value_heads") or heads
    width = 4 if dtype == "float32" else 2
    return 2 * config["num_hidden_layers"] * kv_heads * head_dim * width


def check_kv_cache(model_path: str | Path, config: EngineConfig, dtype: str) -> None:
    """Refuse a KV cache that cannot hold one `engine.max_model_len` sequence, in rollflow's keys
    (vLLM's own message, from the engine process, names settings rollflow does not have)."""
    try:
        per_token = kv_bytes_per_token(model_path, dtype)
    except (OSError, KeyError, TypeError, ValueError, ZeroDivisionError):
        return  # an architecture this estimate does not know: vLLM checks it
    needed = per_token * config.max_model_len
    if config.kv_cache_bytes < needed:
        fits = config.kv_cache_bytes // per_token
        raise ConfigError(
            f"engine.kv_cache_bytes: {config.kv_cache_bytes} bytes hold {fits} tokens of {model_path} "
            f"({per_token} bytes each in {dtype}), fewer than one engine.max_model_len = {config.max_model_len} "
            f"sequence ({needed} bytes); raise engine.kv_cache_bytes or lower engine.max_model_len"
        )


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
        flat_logprobs=True,  # a few flat lists per request, not a dict and an object per token
        # FINAL_ONLY spares the client one Python round trip per token when nobody watches.
        output_kind=RequestOutputKind.DELTA if deltas else RequestOutputKind.FINAL_ONLY,
        # vLLM matches stop sequences in the text it detokenizes; without any, no text is made.
        stop=list(sampling.stop) or None,
        include_stop_str_in_output=True,
        detokenize=bool(sampling.stop),
    )


def sampled_logprobs(token_ids: list[int], entries: Any) -> list[float]:
    """The sampled tokens' log-probs from vLLM's record of a request's (`sampling_params`):
    flat lists, where each position's first entry is its sampled token, or one dict per
    position keyed by token (vLLM's other form)."""
    from vllm.logprobs import FlatLogprobs

    if entries is None:
        return []
    if isinstance(entries, FlatLogprobs):
        starts = entries.start_indices[: len(token_ids)]
        if any(entries.token_ids[s] != t for s, t in zip(starts, token_ids, strict=False)):
            raise EngineError("vLLM's log-probs do not start with the sampled tokens")
        return [entries.logprobs[s] for s in starts]
    return [entry[token].logprob for token, entry in zip(token_ids, entries, strict=False)]


STEP_TOKENS = 2048
"""vLLM's default token budget of one engine step; `whole_prefills` keeps it unless a prompt is longer."""


def whole_prefills(config: EngineConfig) -> dict[str, Any]:
    """On CPU, vLLM's engine arguments that prefill every prompt within one step (no chunked
    prefill), the step's token budget raised to the longest context when that is longer; {} on a GPU.

    Every request of a run carries a seed. When a prompt's prefill is split across steps, vLLM
    0.32 rewinds the request's seeded generator by the offset of the token it discards, and a
    CPU generator has no offset: the engine core dies (`CPU Generator does not use offset`)."""
    import torch

    if torch.cuda.is_available():
        return {}
    return {"enable_chunked_prefill": False, "max_num_batched_tokens": max(config.max_model_len, STEP_TOKENS)}


def engine_args(model_path: str, config: EngineConfig, dtype: str) -> Any:
    """vLLM's `AsyncEngineArgs` for an in-process engine: the model, the KV cache and batch size,
    log-probs as sampled, rollflow's worker extension, prefix caching, eager mode and LoRA when
    asked."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    from rollflow.engine.quiet import verbose

    lora: dict[str, Any] = {}  # optional engine arguments
    if config.max_loras:
        lora = {
            "enable_lora": True,
            "max_loras": config.max_loras,
            "max_cpu_loras": config.max_loras,
            "max_lora_rank": config.max_lora_rank,
        }
    if config.weight_transfer:
        lora["weight_transfer_config"] = {"backend": config.weight_transfer}
    return AsyncEngineArgs(
        model=model_path,
        dtype=dtype,  # type: ignore[arg-type]
        seed=config.seed,
        max_model_len=config.max_model_len,
        max_num_seqs=config.max_num_seqs,
        kv_cache_memory_bytes=config.kv_cache_bytes,
        logprobs_mode=config.logprobs_mode,
        worker_extension_cls=WORKER_EXTENSION,
        enable_prefix_caching=True,
        enforce_eager=config.enforce_eager,
        disable_log_stats=True,
        enable_log_requests=False,
        use_tqdm_on_load=verbose(),  # a progress bar per start otherwise
        **whole_prefills(config),
        **lora,
    )


def serve_command(model_path: str | Path, config: EngineConfig, *, host: str, port: int, dtype: str) -> list[str]:
    """The command line of a vLLM server that a `RemoteEngine` can drive (run it with the
    environment of `serve_environment`)."""
    config = resolve_context(config, model_path)
    whole = whole_prefills(config)
    steps = ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(whole["max_num_batched_tokens"])]
    return [
        sys.executable,
        "-m",
        "vllm.entrypoints.launchers.api_server.entry",
        "--model", str(model_path),
        "--host", host,
        "--port", str(port),
        "--dtype", dtype,
        "--seed", str(config.seed),
        "--max-model-len", str(config.max_model_len),
        "--max-num-seqs", str(config.max_num_seqs),
        "--kv-cache-memory-bytes", str(config.kv_cache_bytes),
        "--logprobs-mode", config.logprobs_mode,
        "--worker-extension-cls", WORKER_EXTENSION,
        "--enable-prefix-caching",
        "--enable-scale-out",  # the token-in/token-out endpoint
        "--disable-log-stats",
    ] + (steps if whole else []) + (
        ["--weight-transfer-config", json.dumps({"backend": config.weight_transfer})] if config.weight_transfer else []
    ) + (["--enforce-eager"] if config.enforce_eager else [])  # fmt: skip


def serve_environment(config: EngineConfig) -> dict[str, str]:
    """Environment of the server process: `engine_environment` under the user's own settings,
    with the RL and developer endpoints on (/pause, /resume, weight labels, /collective_rpc)."""
    own = engine_environment(config)
    return own | dict(os.environ) | {"VLLM_SERVER_DEV_MODE": "1", LINEAR_LAYOUT: own[LINEAR_LAYOUT]}


SHUTDOWN_GRACE_S = 30.0
"""How long the engine core process may take to exit after its shutdown before it is killed.
Its teardown (freeing the compiled model, interpreter exit) takes 4-6 s on a 2-core CPU, around
vLLM's default of 5 s, after which it kills the process and prints a warning."""


async def shut_down(llm: Any) -> None:
    """Shut an `AsyncLLM`'s engine down (off the loop), once: vLLM's `AsyncLLM.__del__` shuts it
    down again, and when the object is collected only as the interpreter exits, that second call
    finds vLLM's modules half torn down and prints a traceback, so it is made a no-op."""
    await asyncio.to_thread(llm.shutdown, SHUTDOWN_GRACE_S)
    llm.shutdown = lambda *args, **kwargs: None


async def shut_down_when_built(building: asyncio.Future[Any]) -> None:
    """Shut down the engine a start that timed out is still building, once it is built."""
    try:
        llm = await building
    except Exception:  # the late start failed: nothing was left running
        return
    await shut_down(llm)
