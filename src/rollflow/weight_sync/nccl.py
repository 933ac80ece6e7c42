"""The `nccl` transport (GPU machines): vLLM's NCCL weight-transfer engine, packed broadcasts.

On GPU, vLLM ships a trainer-side engine (`NCCLTrainerWeightTransferEngine`) that opens an NCCL
group with the inference workers and drives their `init_weight_transfer_engine` /
`start_weight_update` / `update_weights` / `finish_weight_update` calls while it broadcasts
packed buffers. This module plugs rollflow into it: `EngineClient` lets that synchronous
trainer-side code call the in-process AsyncLLM on the controller's loop, and `PlanSource`
presents a bucket plan's (name, dtype, shape) list and the trainer's weights as vLLM's
`WeightSource`. Everything runs inside rollflow's critical section like the other transports.

The engine (in-process, or a server from `rollflow serve-engine`) must be started with
`engine.weight_transfer = "nccl"`. This path needs CUDA: on CPU
only the argument plumbing is checked (tests/unit/test_nccl_plumbing.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Iterator
from dataclasses import asdict
from typing import Any

import torch

from rollflow.weight_sync import Run, in_thread
from rollflow.weight_sync.buckets import BucketPlan, _dtype

DEFAULT_NUM_BUFFERS = 2
"""Packed buffers in flight (double buffering)."""


def update_info(plan: BucketPlan) -> dict[str, Any]:
    """The per-round payload vLLM's NCCL receiver expects: names, dtype names, shapes."""
    return {
        "names": [t.name for t in plan.tensors],
        "dtype_names": [t.dtype for t in plan.tensors],
        "shapes": [list(t.shape) for t in plan.tensors],
    }


class EngineClient:
    """vLLM's synchronous weight-sync client interface, over an in-process AsyncLLM.

    Called from the thread that runs the trainer-side send; each call is scheduled on the
    controller's event loop and waited for.
    """

    def __init__(self, llm: Any, loop: asyncio.AbstractEventLoop) -> None:
        self.llm = llm
        self.loop = loop

    def _run(self, coroutine: Any) -> None:
        asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        self._run(self.llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init_info)))

    def shutdown_weight_transfer_engine(self) -> None:
        self._run(self.llm.shutdown_weight_transfer_engine())

    def start_weight_update(self) -> None:
        self._run(self.llm.start_weight_update())

    def update_weights(self, update_info: dict[str, Any]) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        self._run(self.llm.update_weights(WeightTransferUpdateRequest(update_info=update_info)))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        # rollflow's critical section labels the version itself, after the load.
        self._run(self.llm.finish_weight_update())


def plan_source(plan: BucketPlan, tensors: Iterable[tuple[str, torch.Tensor]]) -> Any:
    """A vLLM `WeightSource` declaring the plan's parameters and yielding `tensors` once."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    class PlanSource(WeightSource):
        def metadata(self) -> list[ParamMeta]:
            return [ParamMeta(t.name, _dtype(t.dtype), tuple(t.shape)) for t in plan.tensors]

        def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
            yield from tensors

    return PlanSource()


def trainer_init_info(host: str, port: int, num_workers: int, *, buffer_bytes: int, rank: int = 0) -> Any:
    """Init info for the trainer side: rank 0 sends to `num_workers` inference workers."""
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

    return NCCLTrainerInitInfo(
        master_address=host,
        master_port=port,
        world_size=1 + num_workers,
        packed=True,
        packed_buffer_size_bytes=buffer_bytes,
        packed_num_buffers=DEFAULT_NUM_BUFFERS,
        rank=rank,
    )


class NcclTransport:
    """Trainer rank 0 (this process, on a GPU) -> vLLM workers over vLLM's NCCL engine."""

    name = "nccl"
    snapshots = False

    def __init__(
        self, host: str = "127.0.0.1", port: int = 29600, num_workers: int = 1, buffer_bytes: int = 256 * 1024 * 1024
    ) -> None:
        self.host, self.port, self.num_workers, self.buffer_bytes = host, port, num_workers, buffer_bytes
        self._trainer: Any = None
        self._staged: list[tuple[str, torch.Tensor]] = []

    def worker_call(self, plan: Any) -> None:
        """None: no single worker call loads these weights (`load` does)."""
        return None

    async def connect(self, engine: Any) -> None:
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerWeightTransferEngine

        if not torch.cuda.is_available():
            raise RuntimeError("the nccl weight transport needs CUDA; use gloo or shm on CPU")
        # An in-process engine's AsyncLLM, or a remote server's endpoints with the same calls.
        api = engine.weight_transfer_api()
        client: Any = EngineClient(api, asyncio.get_running_loop())
        info = trainer_init_info(self.host, self.port, self.num_workers, buffer_bytes=self.buffer_bytes)
        empty = plan_source(BucketPlan(tensors=[], bucket_sizes=[]), [])
        self._trainer = await asyncio.to_thread(
            NCCLTrainerWeightTransferEngine.trainer_init, info, client=client, source=empty
        )

    async def stage(self, plan: BucketPlan, tensors: Iterable[tuple[str, torch.Tensor]], run: Run = in_thread) -> int:
        # No copy: the GPU tensors are sent straight from the trainer, so `load` must finish
        # before the trainer changes them (snapshots = False keeps the controller waiting).
        def gather() -> int:  # gathering shards: off the loop, where `run` says
            self._staged = list(tensors)
            return plan.total_bytes

        return await run(gather)

    async def load(self, engine: Any, plan: BucketPlan) -> None:
        if self._trainer is None:
            await self.connect(engine)
        self._trainer.source = plan_source(plan, self._staged)
        try:
            await asyncio.to_thread(self._trainer.send_weights)
        finally:
            self._staged = []

    async def aclose(self) -> None:
        if self._trainer is not None:
            await asyncio.to_thread(self._trainer.shutdown)
            self._trainer = None


def check_update_info(plan: BucketPlan) -> Any:
    """Validate the payload with vLLM's own dataclass (what the receiver will build from it)."""
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferUpdateInfo

    return NCCLWeightTransferUpdateInfo(**update_info(plan))


def worker_init_payload(host: str, port: int, num_workers: int, buffer_bytes: int) -> dict[str, Any]:
    """The worker-side init payload vLLM's trainer engine derives from the trainer init info."""
    from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo

    info = trainer_init_info(host, port, num_workers, buffer_bytes=buffer_bytes)
    worker = NCCLWeightTransferInitInfo(
        master_address=info.master_address,
        master_port=info.master_port,
        rank_offset=1,
        world_size=info.world_size,
        packed=True,
        packed_buffer_size_bytes=buffer_bytes,
        packed_num_buffers=DEFAULT_NUM_BUFFERS,
    )
    return {k: v for k, v in asdict(worker).items() if v is not None}
