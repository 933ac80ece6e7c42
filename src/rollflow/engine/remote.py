"""A vLLM server as rollflow's `Engine`, over HTTP (aiohttp): inference on another process or machine.

The server is vLLM's own API server started with rollflow's worker extension, the RL and
developer endpoints and the token-in/token-out endpoint (`python -m rollflow serve-engine`, see
`serve_command`). What this client uses:

- `POST /inference/v1/generate` (streamed): token ids in, token ids and the sampled token's
  log-prob out, and on the final chunk the server's weight-version spans over the output tokens;
- `POST /inference/v1/abort_requests`, `/pause?mode=keep|abort`, `/resume`,
  `/update_weight_version`, `/reset_prefix_cache`, `/collective_rpc` (the worker extension's
  weight loading), `GET /health`;
- on GPU servers, the weight-transfer endpoints (`/init_weight_transfer_engine`,
  `/start_weight_update`, `/update_weights`, `/finish_weight_update`) for the `nccl` transport.

Per-token versions are exact for the same reason as in-process: the server's engine core labels
each step's outputs with its current weight label, and the label only changes inside the update's
critical section, while generation is paused — which this client runs (pause -> load -> label ->
reset prefix cache -> resume). The client never guesses a version from timing.

What it does not do: start or restart the server (a dead server is an `EngineDeadError`; the
pool re-queues its work elsewhere), or report a running request's progress (`partial` is None: a
checkpoint keeps a remote sample's tokens up to its last finished request, which stays exact).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import tempfile
import time
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

from rollflow.config import EngineConfig
from rollflow.engine import (
    EngineOutput,
    Load,
    ManagedEngine,
    PartialMode,
    Weights,
    critical_section,
    load_callable,
    named,
    spans_to_versions,
)
from rollflow.errors import EngineDeadError, EngineError, WeightSyncError
from rollflow.records import SamplingSpec

log = logging.getLogger(__name__)

SERVER_ID_PREFIX = "generate-tokens-"
"""The server runs a generate request under this prefix + the client's id (what abort needs)."""

HEALTH_POLL_S = 1.0
"""How often `start` asks a server that is still starting whether it is up."""
WAIT_REPORT_S = 10.0
"""How often a start still waiting for its server says so."""


class RemoteEngine:
    """rollflow's `Engine` over a vLLM server at `url`."""

    def __init__(self, url: str, config: EngineConfig = EngineConfig()) -> None:  # noqa: B008 - frozen
        self.url = url.rstrip("/")
        self.config = config
        self._session: Any = None
        self._version = 0
        self._update_lock = asyncio.Lock()
        self._aborted: set[str] = set()
        self._live: set[str] = set()
        self._dead: EngineDeadError | None = None

    @property
    def version(self) -> int:
        return self._version

    @property
    def num_live(self) -> int:
        return len(self._live)

    async def start(self) -> RemoteEngine:
        """Wait for the server to answer (up to `engine.start_timeout_s`) and label its weights
        version 0."""
        import aiohttp

        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=10))
        began = told = time.monotonic()
        while True:
            try:
                async with self._session.get(f"{self.url}/health") as resp:
                    if resp.status == 200:
                        break
                    last = f"/health answered {resp.status}"
            except aiohttp.ClientConnectorDNSError as err:  # no such host: waiting will not help
                await self.aclose()
                raise EngineError(f"vLLM server {self.url}: cannot resolve its host ({err.os_error})") from None
            except aiohttp.ClientError as err:
                last = f"/health: {type(err).__name__}"
            waited = time.monotonic() - began
            if waited > self.config.start_timeout_s:
                await self.aclose()
                raise EngineError(
                    f"vLLM server {self.url} did not answer /health within {self.config.start_timeout_s:.0f} s "
                    f"(engine.start_timeout_s; last: {last})"
                )
            if time.monotonic() - told >= WAIT_REPORT_S:
                told = time.monotonic()
                log.warning(
                    "waiting for vLLM server %s (%s): %.0f s of %.0f s (engine.start_timeout_s)",
                    self.url,
                    last,
                    waited,
                    self.config.start_timeout_s,
                )
            await asyncio.sleep(HEALTH_POLL_S)
        await self._post("/update_weight_version", {"new_version": str(self._version)})
        log.info("vLLM server %s ready after %.1f s", self.url, time.monotonic() - began)
        return self

    async def __aenter__(self) -> RemoteEngine:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _intact(self) -> bool:
        return all(await self.rpc("rollflow_weights_intact"))

    async def _take_out_of_service(self, reason: str) -> EngineDeadError:
        """A weight update left the server's weights unknown: this client never uses it again
        (its streams end as a dead server's do); a replacement client labels the server's
        weights anew when the controller gives it the trainer's."""
        message = f"vLLM server {self.url} taken out of service: {reason}"
        self._dead = EngineDeadError(message)
        session, self._session = self._session, None
        if session is not None:
            await session.close()
        return EngineDeadError(message)

    def _gone(self, err: BaseException) -> EngineDeadError:
        self._dead = EngineDeadError(f"vLLM server {self.url} is gone: {err or type(err).__name__}")
        return EngineDeadError(str(self._dead))

    async def _post(self, path: str, body: dict[str, Any] | None = None, **params: str) -> Any:
        import aiohttp

        if self._session is None:
            raise self._dead or EngineError("engine not started: call `await engine.start()` first")
        try:
            async with self._session.post(f"{self.url}{path}", json=body or {}, params=params or None) as resp:
                text = await resp.text()
                if resp.status != 200:
                    raise EngineError(f"vLLM server {self.url}{path}: HTTP {resp.status}: {text[:500]}")
                return json.loads(text) if text else None
        except (aiohttp.ClientConnectionError, ConnectionError) as err:
            raise self._gone(err) from err

    async def stream(
        self, request_id: str, prompt_token_ids: list[int], sampling: SamplingSpec, *, deltas: bool = True
    ) -> AsyncGenerator[EngineOutput, None]:
        import aiohttp

        if self._session is None:
            raise self._dead or EngineError("engine not started: call `await engine.start()` first")
        body = {
            "request_id": request_id,
            "token_ids": prompt_token_ids,
            "sampling_params": {
                "temperature": sampling.temperature,
                "top_p": sampling.top_p,
                "top_k": sampling.top_k if sampling.top_k > 0 else -1,
                "max_tokens": sampling.max_tokens,
                "ignore_eos": sampling.ignore_eos,
                "seed": sampling.seed,
                "logprobs": 0,  # the sampled token's log-prob only
                "stop": list(sampling.stop),
                "include_stop_str_in_output": True,
                "detokenize": bool(sampling.stop),  # vLLM matches stop sequences in its text
            },
            "stream": True,
            # Salt the prefix cache by version: a request never reuses KV computed under older weights.
            "cache_salt": f"v{self._version}",
        }
        tokens: list[int] = []
        logprobs: list[float] = []
        self._live.add(request_id)
        finished = False
        try:
            async with self._session.post(f"{self.url}/inference/v1/generate", json=body) as resp:
                if resp.status != 200:
                    raise EngineError(f"request {request_id}: HTTP {resp.status}: {(await resp.text())[:500]}")
                async for line in resp.content:
                    if not line.startswith(b"data: "):
                        continue
                    payload = line[6:].strip()
                    if payload == b"[DONE]":
                        break
                    chunk = json.loads(payload)
                    if "error" in chunk:
                        raise EngineError(f"request {request_id}: {chunk['error']}")
                    choice = chunk["choices"][0]
                    new = choice.get("token_ids") or []
                    new_logprobs = [entry["logprob"] for entry in (choice.get("logprobs") or {}).get("content") or []]
                    if len(new_logprobs) != len(new):
                        raise EngineError(f"request {request_id}: {len(new)} tokens but {len(new_logprobs)} log-probs")
                    tokens += new
                    logprobs += new_logprobs
                    reason = choice.get("finish_reason")
                    if reason is None:
                        if deltas and new:
                            yield EngineOutput(new, new_logprobs)
                        continue
                    spans = choice.get("weight_versions") or []
                    versions = spans_to_versions(
                        ((int(s["version"]), s["start"], s["end"]) for s in spans), len(tokens)
                    )
                    if reason == "abort" and request_id not in self._aborted:
                        reason = "preempted"  # only a weight update aborts what the caller did not
                    finished = True
                    if deltas:
                        yield EngineOutput(new, new_logprobs, reason, versions)
                    else:
                        yield EngineOutput(tokens, logprobs, reason, versions)
                    return
            if not finished:
                raise self._gone(ConnectionError(f"the stream of request {request_id} ended without a finish reason"))
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, ConnectionError) as err:
            raise self._gone(err) from err
        finally:
            self._live.discard(request_id)
            self._aborted.discard(request_id)
            if not finished and self._dead is None and self._session is not None:
                # Cancelled mid-stream: closing the connection is not an abort for every server.
                await asyncio.shield(self._abort_quietly(request_id))

    async def _abort_quietly(self, request_id: str) -> None:
        # The request may be gone with the server, or already finished.
        with contextlib.suppress(EngineError, OSError):
            await self._post("/inference/v1/abort_requests", {"request_ids": [SERVER_ID_PREFIX + request_id]})

    def partial(self, request_id: str) -> EngineOutput | None:
        """Not known for a remote request (see the module docstring)."""
        return None

    async def abort(self, request_id: str) -> None:
        if request_id in self._live:
            self._aborted.add(request_id)
            await self._post("/inference/v1/abort_requests", {"request_ids": [SERVER_ID_PREFIX + request_id]})

    async def pause(self, *, keep: bool = True) -> None:
        await self._post("/pause", mode="keep" if keep else "abort", clear_cache="false")

    async def resume(self) -> None:
        await self._post("/resume")

    async def rpc(self, method: str, *args: Any) -> list[Any]:
        """Call a `WorkerExtension` method on every worker of the server (bytes travel as base64)."""
        encoded = [base64.b64encode(a).decode() if isinstance(a, bytes) else a for a in args]
        answer = await self._post("/collective_rpc", {"method": method, "args": encoded})
        return list((answer or {}).get("results") or [])

    async def check_health(self) -> None:
        import aiohttp

        if self._session is None:
            raise self._dead or EngineError("engine not started: call `await engine.start()` first")
        try:
            async with self._session.get(f"{self.url}/health") as resp:
                if resp.status != 200:
                    raise self._gone(ConnectionError(f"/health answered HTTP {resp.status}"))
        except (aiohttp.ClientConnectionError, ConnectionError) as err:
            raise self._gone(err) from err

    async def update_weights(
        self, weights: Weights, *, partial: PartialMode = "keep", version: int | None = None
    ) -> int:
        """Load named tensors through a RAM-backed folder the server reads (same host only; across
        hosts weights travel with the gloo transport)."""
        from safetensors.torch import save_file

        tensors = {name: tensor.detach().contiguous().cpu() for name, tensor in named(weights)}
        shm = Path("/dev/shm")
        with tempfile.TemporaryDirectory(prefix="rollflow-weights-", dir=shm if shm.is_dir() else None) as folder:
            save_file(tensors, Path(folder) / "model.safetensors")
            return await self.update_weights_with(
                lambda: self.rpc("rollflow_load_path", folder), partial=partial, version=version
            )

    async def update_weights_with(
        self,
        load: Load,
        *,
        partial: PartialMode = "keep",
        deadline_s: float | None = None,
        version: int | None = None,
    ) -> int:
        """The weight-update critical section around `load()`, as `VLLMEngine.update_weights_with`:
        pause -> load -> label -> reset the prefix cache -> resume (always) -> bump the version."""
        keep = partial == "keep"
        recompute = str(keep and not self.config.keep_kv_on_update).lower()
        async with self._update_lock:
            new_version = self._version + 1 if version is None else version
            await critical_section(
                f"vLLM server {self.url}",
                self._version,
                [
                    ("pause", lambda: self.pause(keep=keep)),
                    ("load", load_callable(self, load)),
                    ("label", lambda: self._post("/update_weight_version", {"new_version": str(new_version)})),
                    (
                        "reset prefix cache",
                        lambda: self._post("/reset_prefix_cache", reset_running_requests=recompute),
                    ),
                ],
                deadline_s=deadline_s if deadline_s is not None else self.config.update_deadline_s,
                resume=self.resume,
                can_resume=lambda: self._dead is None and self._session is not None,
                intact=self._intact,
                lose=self._take_out_of_service,
            )
            self._version = new_version
        return self._version

    async def update_adapter(
        self,
        tensors: dict[str, Any],
        adapter_config: dict[str, Any],
        *,
        partial: PartialMode = "keep",
        version: int | None = None,
    ) -> int:
        raise WeightSyncError(
            f"{self.url}: a remote engine takes full weights only; LoRA adapters need an in-process engine"
        )

    def engines(self) -> list[ManagedEngine]:
        return [self]

    def targets(self) -> list[ManagedEngine]:
        return [self]

    def weight_transfer_api(self) -> WeightTransferAPI:
        """vLLM's weight-transfer calls (what the `nccl` transport drives) over this server's endpoints."""
        return WeightTransferAPI(self)

    async def generate(self, prompt_token_ids: list[int], sampling: SamplingSpec, request_id: str) -> EngineOutput:
        """Convenience: the whole completion as one output."""
        async for out in self.stream(request_id, prompt_token_ids, sampling, deltas=False):
            return out
        raise EngineError(f"request {request_id}: stream ended without a finish reason")

    async def aclose(self) -> None:
        """Abort this client's requests and close its connections (the server keeps running)."""
        if self._session is None:
            return
        for request_id in list(self._live):
            await self._abort_quietly(request_id)
        session, self._session = self._session, None
        await session.close()


class WeightTransferAPI:
    """AsyncLLM's weight-transfer methods, as calls to a server's RL endpoints (for GPU servers
    started with `engine.weight_transfer = "nccl"`; the data itself moves over NCCL)."""

    def __init__(self, engine: RemoteEngine) -> None:
        self.engine = engine

    async def init_weight_transfer_engine(self, request: Any) -> None:
        await self.engine._post("/init_weight_transfer_engine", {"init_info": request.init_info})

    async def shutdown_weight_transfer_engine(self) -> None:
        await self.engine._post("/shutdown_weight_transfer_engine")

    async def start_weight_update(self) -> None:
        await self.engine._post("/start_weight_update")

    async def update_weights(self, request: Any) -> None:
        await self.engine._post("/update_weights", {"update_info": request.update_info})

    async def finish_weight_update(self, weight_version: str | None = None) -> None:
        await self.engine._post("/finish_weight_update", {"weight_version": weight_version})
