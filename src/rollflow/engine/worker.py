"""Code that runs inside vLLM's worker process (named in `worker_extension_cls`).

vLLM mixes `WorkerExtension` into its worker class, so these methods run next to the model
and are reached from the engine adapter through `collective_rpc`. Weights arrive as
safetensors bytes (collective_rpc carries bytes natively; raw tensors would arrive as lists)
or as a path, and are loaded through vLLM's layerwise reload, because a plain
`model.load_weights` after startup fails on the CPU backend (it repacks linear weights).
This module must stay importable without rollflow's heavier dependencies.
"""

from __future__ import annotations


class WorkerExtension:
    """Methods added to vLLM's worker; `self` is the worker."""

    def rollflow_load_safetensors(self, data: bytes) -> int:
        """Load named tensors serialised with safetensors; returns how many were loaded."""
        from safetensors.torch import load

        tensors = load(data)
        self.reload_weights(weights_iterator=iter(tensors.items()))  # type: ignore[attr-defined]
        return len(tensors)

    def rollflow_load_path(self, path: str) -> int:
        """Load every `*.safetensors` file in a folder."""
        from pathlib import Path

        from safetensors.torch import load_file

        files = sorted(Path(path).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{path}: no .safetensors files to load")

        def weights():
            for file in files:
                yield from load_file(file).items()

        self.reload_weights(weights_iterator=weights())  # type: ignore[attr-defined]
        return len(files)
