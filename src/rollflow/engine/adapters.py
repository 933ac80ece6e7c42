"""The LoRA adapters one vLLM engine holds, by version (adapter-only weight sync).

vLLM loads an adapter from a folder, so each version is written to a RAM-backed folder
(`/dev/shm` when present) as `adapter_model.safetensors` + `adapter_config.json`. A request
keeps the adapter it started with to its end (`use` / `release` count the users), so adapters
that are neither among the newest few nor in use can be unloaded (`unused`: an episode's
later turns may ask for the version its first turn used). `AdapterSync` is the
adapter-only weight sync a `rollflow.engine.vllm.VLLMEngine` holds (loading, unloading, versions).
"""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollflow.engine import PartialMode
from rollflow.engine.updates import unless_dead
from rollflow.errors import EngineDeadError, WeightSyncError
from rollflow.scratch import scratch_dir

if TYPE_CHECKING:
    from rollflow.engine.vllm import VLLMEngine


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
            self._directory = scratch_dir("lora", in_memory=True)
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

    def unused(self, newest: int, keep: int = 1) -> list[Any]:
        """Forget the adapters neither among the `keep` newest versions nor used by a request;
        returns their requests (for the engine to unload, then `remove` their folders)."""
        gone = []
        for version, request in list(self.loaded.items()):
            if version <= newest - keep and self._users.get(version, 0) == 0:
                del self.loaded[version]
                self._users.pop(version, None)
                gone.append(request)
        return gone

    @staticmethod
    def remove(requests: list[Any]) -> None:
        """Delete the folders of unloaded adapters (blocking file IO: call it in a thread)."""
        for request in requests:
            shutil.rmtree(request.lora_path, ignore_errors=True)

    def close(self) -> None:
        if self._directory is not None:
            shutil.rmtree(self._directory, ignore_errors=True)


class AdapterSync:
    """Adapter-only weight sync of one `VLLMEngine`, which holds it (`engine.adapter_sync`) and
    whose version, update lock and adapters it reads and advances."""

    def __init__(self, engine: VLLMEngine) -> None:
        self.engine = engine

    async def update_adapter(
        self,
        tensors: dict[str, Any],
        adapter_config: dict[str, Any],
        *,
        partial: PartialMode = "keep",
        version: int | None = None,
    ) -> int:
        """Adapter-only sync: load a LoRA adapter as the next version; returns it.

        New requests use the newest adapter. In `keep` mode in-flight requests finish on the
        adapter they started with (their tokens keep its version); in `resume` / `restart` mode
        they are preempted and resubmitted on the new one. Adapters no request uses any more are
        unloaded. The adapter travels through a RAM-backed folder (vLLM loads adapters by path).
        `version` labels the adapter with that version instead of the next (a resumed run).
        """
        from vllm.v1.engine.exceptions import EngineDeadError as VLLMDead

        engine = self.engine
        if not engine.config.max_loras:
            raise WeightSyncError("adapter sync needs a LoRA-enabled engine: set engine.max_loras > 0")
        async with engine._update_lock:
            version = engine._version + 1 if version is None else version
            request = await asyncio.to_thread(engine.adapters.write, version, tensors, adapter_config)
            try:
                async with asyncio.timeout(engine.config.update_deadline_s):
                    await unless_dead(engine.llm, engine.llm.add_lora(request))
            except VLLMDead as err:
                raise engine._dead(err) from err
            except EngineDeadError:
                raise
            except Exception as err:
                raise WeightSyncError(f"adapter version {version} failed to load: {err}") from err
            engine.adapters.add(version, request)
            engine._version = version
            if partial != "keep":
                for request_id in list(engine._live):
                    await engine.llm.abort(request_id)  # not user aborts: they come back as preempted
        await self.collect()
        return version

    @property
    def keep(self) -> int:
        """How many of the newest versions stay loaded: `engine.max_loras - 1` (an episode's later
        turns may ask for the version its first turn used: `SamplingSpec.on_version`), one slot
        left free for the next."""
        return max(1, self.engine.config.max_loras - 1)

    def holds(self, version: int | None) -> bool:
        """Whether a new request can still generate with adapter `version`: it is loaded, or it
        is 0 (the base model, which needs no adapter) and still among the `keep` newest."""
        engine = self.engine
        return version in engine.adapters.loaded or (version == 0 and engine._version < self.keep)

    async def collect(self) -> None:
        """Unload adapters that are neither among the `keep` newest nor used by an in-flight request."""
        engine = self.engine
        gone = engine.adapters.unused(engine._version, keep=self.keep)
        for request in gone:
            await engine.llm.remove_lora(request.lora_int_id)
        if gone:
            await asyncio.to_thread(Adapters.remove, gone)
