"""The `gloo` transport: trainer rank 0 broadcasts packed buckets to the vLLM worker.

The two ends form their own two-process gloo group (a TCPStore served by the trainer side,
bound to 127.0.0.1 unless told otherwise), separate from the trainers' group. Each sync sends
the bucket plan's length and the sync's kind, the plan (msgpack bytes), and then either every
bucket (`FULL`) or, once both ends hold the previous sync's weights, only what changed since
(`DELTA`: `rollflow.weight_sync.delta`; the receiver applies it to its receive buffers, which
hold the previous sync). The group's timeout bounds every blocking call, so a dead or stalled
peer is an error, never a hang.

Both halves are here: `GlooSender` runs on the trainer side (blocking; `GlooTransport` calls it
from a thread); `GlooReceiver` (with `receive_buckets`) runs inside vLLM's worker, which makes
it from the name the sender gives (`RECEIVER`) and knows it only as a
`rollflow.engine.worker.Receiver`. This module does not pause the engine or bump versions; the
critical section in the engine adapter does.
"""

from __future__ import annotations

import socket
from collections.abc import Iterable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from rollflow.weight_sync import delta
from rollflow.weight_sync.buckets import BucketPlan, bucket_starts, pack, unpack

PREFIX = "rollflow-weights"
"""Key prefix in the rendezvous store, so the group cannot collide with others on it."""

FULL, DELTA = 0, 1
"""The kinds of sync: every bucket, or the changes since the previous sync."""


def _options(host: str, timeout_s: float) -> Any:
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._timeout = timedelta(seconds=timeout_s)
    # Bind to the rendezvous host's interface (loopback by default), not the hostname's.
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return options


def join(host: str, port: int, rank: int, timeout_s: float, store: dist.TCPStore | None = None) -> dist.ProcessGroup:
    """Join the two-process weight group as `rank` (0 = trainer side, 1 = engine side)."""
    if store is None:
        store = dist.TCPStore(host, port, 2, is_master=False, timeout=timedelta(seconds=timeout_s))
    return dist.ProcessGroupGloo(dist.PrefixStore(PREFIX, store), rank, 2, _options(host, timeout_s))  # type: ignore[return-value]


def _broadcast(group: dist.ProcessGroup, tensor: torch.Tensor) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    opts.rootTensor = 0
    group.broadcast([tensor], opts).wait()


class GlooSender:
    """The trainer end: serves the rendezvous, then sends plans and buckets (blocking calls)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, timeout_s: float = 60.0) -> None:
        self.host = host
        self.timeout_s = timeout_s
        # TCPStore's own server listens on every interface; hand it a socket bound to `host`.
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._socket = socket.socket(family, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, port))
        self._socket.listen(16)
        self.port = self._socket.getsockname()[1]
        self._store = dist.TCPStore(
            host,
            self.port,
            2,
            is_master=True,
            timeout=timedelta(seconds=timeout_s),
            wait_for_workers=False,
            master_listen_fd=self._socket.fileno(),
        )
        self._group: dist.ProcessGroup | None = None
        self._scratch = torch.empty(0, dtype=torch.uint8)
        self._base: tuple[BucketPlan, torch.Tensor] | None = None
        """The plan and packed weights of the last `send_packed` kept for deltas (the receiver's
        buffers hold the same)."""
        self.last_sent = 0
        """Bytes the last send put on the wire (plan and headers aside)."""

    def connect(self) -> None:
        """Block until the engine side has joined (it must be asked to join concurrently)."""
        self._group = join(self.host, self.port, 0, self.timeout_s, store=self._store)

    def _send_plan(self, plan: BucketPlan, kind: int = FULL) -> None:
        assert self._group is not None
        encoded = torch.frombuffer(bytearray(plan.encode()), dtype=torch.uint8)
        _broadcast(self._group, torch.tensor([encoded.numel(), kind], dtype=torch.int64))
        _broadcast(self._group, encoded)

    def send(self, plan: BucketPlan, tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Send one full set of weights; returns bytes sent."""
        if self._group is None:
            raise RuntimeError("GlooSender.send before connect()")
        self._send_plan(plan)
        largest = max(plan.bucket_sizes, default=0)
        if self._scratch.numel() < largest:
            self._scratch = torch.empty(largest, dtype=torch.uint8)
        sent = 0
        for _, buffer in pack(plan, tensors, self._scratch):
            _broadcast(self._group, buffer)  # complete before the scratch is refilled
            sent += buffer.numel()
        self._base, self.last_sent = None, sent
        return sent

    def send_packed(self, plan: BucketPlan, memory: torch.Tensor, *, changes: bool = False) -> int:
        """Send weights already packed by `buckets.pack_into` (all buckets back to back); returns
        the bytes sent. `changes`: keep a copy of them, and send only what changed since the
        last such send when there is one of the same plan (the receiver holds it)."""
        if self._group is None:
            raise RuntimeError("GlooSender.send_packed before connect()")
        memory = memory[: plan.total_bytes]
        if changes and self._base is not None and self._base[0] == plan:
            modes, payload = delta.encode(plan, memory, self._base[1])
            self._send_plan(plan, DELTA)
            header = torch.tensor([payload.numel(), *modes], dtype=torch.int64)
            _broadcast(self._group, torch.tensor([header.numel()], dtype=torch.int64))
            _broadcast(self._group, header)
            _broadcast(self._group, payload)
            self.last_sent = header.numel() * 8 + payload.numel()
        else:
            self._send_plan(plan)
            for start, size in zip(bucket_starts(plan), plan.bucket_sizes, strict=True):
                _broadcast(self._group, memory[start : start + size])
            self.last_sent = plan.total_bytes
        if not changes:
            self._base = None
        elif self._base is None or self._base[1].numel() != memory.numel():
            self._base = (plan, memory.clone())
        else:
            self._base[1].copy_(memory)
            self._base = (plan, self._base[1])
        return self.last_sent

    def send_per_tensor(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Unpacked baseline for benchmarks: one broadcast per tensor."""
        if self._group is None:
            raise RuntimeError("GlooSender.send_per_tensor before connect()")
        sent = 0
        for _, tensor in tensors:
            flat = tensor.detach().contiguous().reshape(-1)
            _broadcast(self._group, flat)
            sent += flat.numel() * flat.element_size()
        return sent

    def close(self) -> None:
        self._group = None
        self._socket.close()


def receive_buckets(
    group: dist.ProcessGroup, buffers: list[torch.Tensor] | None = None
) -> tuple[BucketPlan, Iterator[tuple[str, torch.Tensor]]]:
    """The engine end of one sync: the plan, and named views into the received buckets.

    Every bucket (or a delta's whole payload) is received before the first view is handed out,
    so a transfer that fails (peer died, timeout) never touches the model: the engine keeps its
    old weights. The price is one model-sized receive buffer on the engine host; pass the
    previous sync's `buffers` (a list, refilled in place) to reuse it. A delta is applied to
    them, so they must hold the previous sync (a receiver without them refuses it).
    """
    head = torch.zeros(2, dtype=torch.int64)
    _broadcast(group, head)
    size, kind = (int(v) for v in head)
    encoded = torch.empty(size, dtype=torch.uint8)
    _broadcast(group, encoded)
    plan = BucketPlan.decode(encoded.numpy().tobytes())
    if buffers is None:
        buffers = []
    if kind == DELTA:
        if [b.numel() for b in buffers] != plan.bucket_sizes:
            raise RuntimeError("a delta of weights arrived, but this receiver holds no earlier weights of its plan")
        length = torch.zeros(1, dtype=torch.int64)
        _broadcast(group, length)
        header = torch.empty(int(length.item()), dtype=torch.int64)
        _broadcast(group, header)
        payload = torch.empty(int(header[0]), dtype=torch.uint8)
        _broadcast(group, payload)
        delta.apply(plan, buffers, header[1:].tolist(), payload)
    else:
        if [b.numel() for b in buffers] != plan.bucket_sizes:
            buffers[:] = [torch.empty(size, dtype=torch.uint8) for size in plan.bucket_sizes]
        for buffer in buffers:
            _broadcast(group, buffer)
    views = (view for index, buffer in enumerate(buffers) for view in unpack(plan, index, buffer))
    return plan, views


RECEIVER = f"{__name__}:GlooReceiver"
"""How the sender names its receiving end to the engine's worker (`rollflow.engine.worker.Receiver`)."""


class GlooReceiver:
    """The engine end of the group: joined once, then one `receive` per sync, reusing its
    receive buffers while the shapes stay the same. A failed collective leaves the group
    unusable: the next sync needs a new join."""

    stageable = False
    """A load arrives while the sender sends it: nothing is at hand before."""

    def __init__(self) -> None:
        self._group: dist.ProcessGroup | None = None
        self._buffers: list[torch.Tensor] = []

    def open(self, host: str, port: int, timeout_s: float) -> None:
        """Join the two-process group as rank 1 (blocks until rank 0 is there)."""
        self._group = join(host, port, 1, timeout_s)

    def receive(self) -> tuple[int, Iterator[tuple[str, torch.Tensor]]]:
        """(bytes, named views) of one full set of weights."""
        if self._group is None:
            raise RuntimeError("gloo receive before join (or after a failed one)")
        try:
            plan, views = receive_buckets(self._group, self._buffers)
        except Exception:
            self._group = None
            raise
        return plan.total_bytes, views

    def close(self) -> None:
        self._group = None
        self._buffers = []
