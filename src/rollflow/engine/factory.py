"""The engine a config describes: one in-process vLLM engine, one vLLM server, or a pool.

`check_engines` rejects settings that cannot work before anything starts; `make_engine` builds
the engine (the controller calls it again to replace one that died). It does not start engines.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit

from rollflow.config import Config, EngineConfig
from rollflow.engine import ManagedEngine
from rollflow.engine.pool import EnginePool
from rollflow.engine.remote import RemoteEngine
from rollflow.engine.vllm import VLLMEngine
from rollflow.errors import ConfigError


def check_engines(cfg: Config) -> None:
    """Reject an `engine.urls` setting that cannot work, before anything is built."""
    urls = cfg.engine.urls or ["local"]
    for i, url in enumerate(urls):
        parsed = urlsplit(url)
        if url != "local" and (parsed.scheme not in ("http", "https") or not parsed.hostname):
            raise ConfigError(
                f"engine.urls[{i}]: expected 'local' or a server address like http://host:port, got {url!r}"
            )
    if len(urls) > 1 and cfg.run.weight_transport == "nccl":
        raise ConfigError(
            f"engine.urls: a pool of {len(urls)} engines needs run.weight_transport = shm (same host), gloo or "
            "checkpoint (a shared filesystem); NCCL into several engines is not built"
        )
    if cfg.trainer.lora.enabled and urls != ["local"]:
        raise ConfigError("engine.urls: adapter-only (LoRA) sync needs one in-process engine")


def make_engine(model_path: Path, engine_config: EngineConfig, cfg: Config) -> ManagedEngine:
    """The engine `engine.urls` describes: one in-process engine, one server, or a pool."""
    urls = engine_config.urls or ["local"]
    members: list[ManagedEngine] = [
        VLLMEngine(model_path, engine_config, dtype=cfg.model.dtype)
        if url == "local"
        else RemoteEngine(url, engine_config)
        for url in urls
    ]
    return members[0] if len(members) == 1 else EnginePool(members)
