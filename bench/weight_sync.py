"""Weight-sync transports, side by side in one run: packed vs per-tensor, shm and gloo vs memcpy.

Two synthetic models of the same total size: `many-small` (thousands of small tensors, like the
norms and biases of a deep model) and `few-large` (a handful of big matrices). For each, over a
gloo group between this process and a receiver process on 127.0.0.1: one broadcast per tensor
vs packed buckets. Then the shared-memory transport's write (the only copy it makes) against a
plain memcpy of the same bytes measured here. Prints a table and, last,
`RESULT packed_speedup=<x> shm_vs_memcpy=<y> gloo_gbps=<z>`.

    bin/dev python bench/weight_sync.py [--mb 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import machine
import torch

from rollflow.testing import unused_port
from rollflow.weight_sync.buckets import plan_buckets
from rollflow.weight_sync.gloo import GlooSender, _broadcast, join, receive_buckets
from rollflow.weight_sync.shm import ShmSender, map_segment, read_buckets


def models(mb: int) -> dict[str, list[tuple[str, torch.Tensor]]]:
    total = mb * 1024 * 1024 // 4
    small = 4096  # floats: 16 KB tensors
    large = total // 8
    return {
        "many-small": [(f"s{i}", torch.full((small,), float(i))) for i in range(total // small)],
        "few-large": [(f"l{i}", torch.full((large,), float(i))) for i in range(8)],
    }


def receiver(port: int, mb: int, repeats: int) -> None:
    group = join("127.0.0.1", port, 1, 120.0)
    for _, tensors in models(mb).items():
        buffers: list[torch.Tensor] = []
        for _ in range(repeats):
            for _, t in tensors:  # per tensor
                _broadcast(group, torch.empty_like(t))
            done(group)
            _, views = receive_buckets(group, buffers)  # packed, reusing receive buffers
            for _ in views:
                pass
            done(group)


def done(group) -> None:
    """Both ends agree the transfer is over (a broadcast alone returns once the root has sent)."""
    group.allreduce([torch.zeros(1)]).wait()


def timed(fn) -> float:
    began = time.perf_counter()
    fn()
    return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--receiver", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.receiver is not None:
        receiver(args.receiver, args.mb, args.repeats)
        return
    torch.set_num_threads(1)
    port = unused_port()
    sender = GlooSender("127.0.0.1", port, timeout_s=120)
    child = subprocess.Popen(
        [sys.executable, __file__, "--receiver", str(port), "--mb", str(args.mb), "--repeats", str(args.repeats)],
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    sender.connect()
    group = sender._group
    assert group is not None
    rows = []
    results: dict[str, dict[str, float]] = {}
    for name, tensors in models(args.mb).items():
        nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
        plan = plan_buckets((n, t.dtype, tuple(t.shape)) for n, t in tensors)
        per, packed = [], []
        for _ in range(args.repeats):
            per.append(timed(lambda t=tensors: (sender.send_per_tensor(t), done(group))))
            packed.append(timed(lambda p=plan, t=tensors: (sender.send(p, t), done(group))))
        results[name] = {"per": min(per), "packed": min(packed), "bytes": nbytes}
        rows.append((f"gloo per-tensor, {name} ({len(tensors)} tensors)", nbytes, min(per)))
        rows.append((f"gloo packed, {name}", nbytes, min(packed)))
    child.wait(timeout=120)

    tensors = models(args.mb)["few-large"]
    nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
    plan = plan_buckets((n, t.dtype, tuple(t.shape)) for n, t in tensors)
    shm = ShmSender()
    try:
        shm.write(plan, tensors)  # first write faults the segment's pages in
        write = min(timed(lambda: shm.write(plan, tensors)) for _ in range(args.repeats))
        segment = map_segment(shm.name, plan.total_bytes)
        views = read_buckets(segment, plan)
        read = timed(lambda v=views: [t.sum() for _, t in v])
        del views, segment
    finally:
        shm.close()
    dest = [torch.empty_like(t) for _, t in tensors]
    for d, (_, t) in zip(dest, tensors, strict=True):
        d.copy_(t)
    memcpy = min(timed(lambda: [d.copy_(t) for d, (_, t) in zip(dest, tensors, strict=True)])
                 for _ in range(args.repeats))
    rows.append(("shm write (sender's only copy)", nbytes, write))
    rows.append(("memcpy of the same bytes", nbytes, memcpy))
    rows.append(("shm read through views (receiver)", nbytes, read))

    print(f"{'what':<44}{'MB':>8}{'seconds':>10}{'GB/s':>8}")
    for what, size, seconds in rows:
        print(f"{what:<44}{size / 2**20:>8.0f}{seconds:>10.4f}{size / seconds / 1e9:>8.2f}")
    speedup = results["many-small"]["per"] / results["many-small"]["packed"]
    large_speedup = results["few-large"]["per"] / results["few-large"]["packed"]
    gloo_gbps = results["few-large"]["bytes"] / results["few-large"]["packed"] / 1e9
    print(f"packed vs per-tensor: many-small {speedup:.2f}x, few-large {large_speedup:.2f}x")
    print(machine.describe())
    print(f"RESULT packed_speedup={speedup:.2f} shm_vs_memcpy={memcpy / write:.2f} gloo_gbps={gloo_gbps:.2f}")


if __name__ == "__main__":
    main()
