"""The LoRA adapters one vLLM engine holds, by version (adapter-only weight sync).

vLLM loads an adapter from a folder, so each version is written to a RAM-backed folder
(`/dev/shm` when present) as `adapter_model.safetensors` + `adapter_config.json`. A request
keeps the adapter it started with to its end (`use` / `release` count the users), so adapters
that are neither the newest nor in use can be unloaded (`unused`). This module makes no vLLM
call of its own; `rollflow.engine.vllm` does the loading and unloading.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any


class Adapters:
    """Loaded adapter versions, their users and their folders."""

    def __init__(self) -> None:
        self.loaded: dict[int, Any] = {}
        """Version -> its vLLM `LoRARequest`."""
        self._users: dict[int, int] = {}
        self._directory: Path | None = None

    def write(self, version: int, tensors: dict[str, Any], config: dict[str, Any]) -> Any:
        """Write the adapter of `version` to its folder; returns the `LoRARequest` that loads it."""
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        if self._directory is None:
            shm = Path("/dev/shm")
            self._directory = Path(tempfile.mkdtemp(prefix="rollflow-lora-", dir=shm if shm.is_dir() else None))
        folder = self._directory / f"v{version}"
        folder.mkdir()
        state = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
        save_file(state, folder / "adapter_model.safetensors")
        (folder / "adapter_config.json").write_text(json.dumps(config))
        return LoRARequest(lora_name=f"rollflow-v{version}", lora_int_id=version, lora_path=str(folder))

    def add(self, version: int, request: Any) -> None:
        """The engine now serves `request` as adapter `version`."""
        self.loaded[version] = request
        self._users.setdefault(version, 0)

    def use(self, version: int) -> Any:
        """A request starts on adapter `version`; returns its `LoRARequest` (None: base model)."""
        self._users[version] = self._users.get(version, 0) + 1
        return self.loaded.get(version)

    def release(self, version: int) -> None:
        self._users[version] -= 1

    def unused(self, newest: int) -> list[Any]:
        """Forget the adapters neither `newest` nor used by a request; returns their requests
        (for the engine to unload) and removes their folders."""
        gone = []
        for version, request in list(self.loaded.items()):
            if version != newest and self._users.get(version, 0) == 0:
                del self.loaded[version]
                self._users.pop(version, None)
                shutil.rmtree(request.lora_path, ignore_errors=True)
                gone.append(request)
        return gone

    def close(self) -> None:
        if self._directory is not None:
            shutil.rmtree(self._directory, ignore_errors=True)
