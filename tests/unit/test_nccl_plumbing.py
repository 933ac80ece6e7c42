"""The GPU-only nccl transport's plumbing, checked on CPU against vLLM's own types."""

from __future__ import annotations

import asyncio

import pytest
import torch

from rollflow.weight_sync.buckets import plan_buckets
from rollflow.weight_sync.nccl import EngineClient, check_update_info, plan_source, worker_init_payload

pytest.importorskip("vllm")

TENSORS = [("model.embed.weight", torch.zeros(10, 4)), ("lm_head.weight", torch.zeros(10, 4, dtype=torch.bfloat16))]


def test_update_payload_and_source_agree_with_the_plan():
    plan = plan_buckets((n, t.dtype, tuple(t.shape)) for n, t in TENSORS)
    info = check_update_info(plan)  # vLLM's dataclass validates list lengths
    assert info.names == ["model.embed.weight", "lm_head.weight"]
    assert info.dtype_names == ["float32", "bfloat16"]
    assert info.shapes == [[10, 4], [10, 4]]
    source = plan_source(plan, TENSORS)
    meta = source.metadata()
    assert [(m.name, m.dtype, m.shape) for m in meta] == [(n, t.dtype, tuple(t.shape)) for n, t in TENSORS]
    assert [n for n, _ in source] == [n for n, _ in TENSORS]


def test_worker_init_payload_is_what_vllm_accepts():
    from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo

    payload = worker_init_payload("127.0.0.1", 29600, 2, 1 << 20)
    assert payload["rank_offset"] == 1 and payload["world_size"] == 3 and payload["packed"] is True
    assert NCCLWeightTransferInitInfo(**payload).nccl_unique_id_bytes is None  # TCP rendezvous mode


def weight_transfer_calls(client: EngineClient) -> None:
    """What vLLM's trainer-side NCCL engine calls, in order (from its own thread)."""
    client.init_weight_transfer_engine({"rank_offset": 1})
    client.start_weight_update()
    client.update_weights({"names": ["a"]})
    client.finish_weight_update("7")


class RecordingLLM:
    """Stands in for AsyncLLM's weight-transfer methods (the engine side of the protocol)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []

    async def init_weight_transfer_engine(self, request):
        self.calls.append(("init", request.init_info))

    async def start_weight_update(self):
        self.calls.append(("start", None))

    async def update_weights(self, request):
        self.calls.append(("update", request.update_info))

    async def finish_weight_update(self, weight_version=None):
        self.calls.append(("finish", weight_version))

    async def shutdown_weight_transfer_engine(self):
        self.calls.append(("shutdown", None))


@pytest.mark.timeout(30)
async def test_engine_client_runs_vllm_calls_on_the_loop_from_a_thread():
    llm = RecordingLLM()
    client = EngineClient(llm, asyncio.get_running_loop())

    await asyncio.to_thread(weight_transfer_calls, client)
    assert llm.calls == [("init", {"rank_offset": 1}), ("start", None), ("update", {"names": ["a"]}),
                         ("finish", None)]  # the version label is rollflow's, set after the load


@pytest.mark.timeout(30)
async def test_a_remote_server_gets_the_same_calls_over_its_rl_endpoints():
    """The nccl transport drives a remote server through `RemoteEngine.weight_transfer_api`:
    the JSON bodies are what vLLM's endpoints read (`init_info`, `update_info` embedded)."""
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    from rollflow.config import EngineConfig
    from rollflow.engine.environment import serve_command
    from rollflow.engine.remote import RemoteEngine

    calls: list[tuple[str, object]] = []

    async def record(request: web.Request) -> web.Response:
        body = await request.json() if request.can_read_body else None
        calls.append((request.path, body))
        return web.json_response({})

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="")

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_post("/{name}", record)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        engine = await RemoteEngine(f"http://127.0.0.1:{server.port}").start()
        client = EngineClient(engine.weight_transfer_api(), asyncio.get_running_loop())

        await asyncio.to_thread(weight_transfer_calls, client)
        await engine.aclose()
    finally:
        await server.close()
    assert calls == [
        ("/update_weight_version", {"new_version": "0"}),  # start() labels the server's weights
        ("/init_weight_transfer_engine", {"init_info": {"rank_offset": 1}}),
        ("/start_weight_update", {}),
        ("/update_weights", {"update_info": {"names": ["a"]}}),
        ("/finish_weight_update", {"weight_version": None}),  # rollflow labels the version itself
    ]
    command = serve_command("m", EngineConfig(weight_transfer="nccl"), host="127.0.0.1", port=1, dtype="bfloat16")
    assert command[command.index("--weight-transfer-config") + 1] == '{"backend": "nccl"}'
