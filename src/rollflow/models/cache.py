"""Where built and converted models live, and how a folder is published atomically.

A model folder is built in a temporary sibling directory and renamed into place, so a
crashed build never leaves a half-written folder that later runs would trust. This module
does no model building itself.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

CACHE_ENV = "ROLLFLOW_CACHE"
"""Environment variable that overrides the cache root (default `~/.cache/rollflow`)."""


def cache_root() -> Path:
    """The root directory for rollflow's caches (models, converted checkpoints)."""
    root = os.environ.get(CACHE_ENV)
    return Path(root) if root else Path.home() / ".cache" / "rollflow"


def build_once(target: Path, build: Callable[[Path], None]) -> Path:
    """Return `target`, building it with `build(tmp_dir)` first if it does not exist.

    `build` writes into an empty temporary directory; the directory is renamed to `target`
    only after `build` returns, so `target` is either absent or complete.
    """
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        build(tmp)
        try:
            tmp.rename(target)
        except OSError:
            # Another process finished the same build first; its copy is as good as ours.
            if not (target / "config.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
