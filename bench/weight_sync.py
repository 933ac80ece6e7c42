"""Weight-sync transports, side by side in one run: packed vs per-tensor, shm and gloo vs memcpy.

Two synthetic models of the same total size: `many-small` (thousands of small tensors, like the
norms and biases of a deep model) and `few-large` (a handful of big matrices). For each, over a
gloo group between this process and a receiver process on 127.0.0.1: one broadcast per tensor
vs packed buckets. Then the shared-memory transport's write (the only copy it makes) against a
plain memcpy of the same bytes measured here.

Then what `gloo` sends once the engine holds a base (`run.weight_delta`): SmolLM2-135M-Instruct
in bfloat16 takes `--updates` real AdamW steps at learning rate 1e-6 (a language-model loss on
random tokens), and after each the packed weights go to a receiver process over 127.0.0.1 twice,
as every byte and as the changes since the last sync (two groups, side by side). The receiver
applies the changes to its buffers, which it writes out at the end: `delta_exact=1` when they
equal the trainer side's last packed weights bit for bit. `delta_bytes_frac` is the median, over
the updates after the first, of the bytes a delta sends over the full bytes.

Prints tables and, last, `RESULT packed_speedup=<x> shm_vs_memcpy=<y> gloo_gbps=<z>
delta_bytes_frac=<f> delta_exact=<0|1>`.

    bin/dev python bench/weight_sync.py [--mb 64] [--repeats 3] [--updates 6]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

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


def delta_receiver(ports: list[int], out: str) -> None:
    """Two groups (full, delta) with the trainer side; receive until told to stop, then write
    the delta group's buffers to `out`."""
    full, changes = (join("127.0.0.1", port, 1, 300.0) for port in ports)
    buffers: dict[str, list[torch.Tensor]] = {"full": [], "delta": []}
    while True:
        more = torch.zeros(1, dtype=torch.int64)
        _broadcast(full, more)
        if not more.item():
            break
        for name, group in (("full", full), ("delta", changes)):
            _, views = receive_buckets(group, buffers[name])
            for _ in views:
                pass
            done(group)
    torch.save(torch.cat(buffers["delta"]), out)


def delta_part(updates: int) -> dict[str, float]:
    """Full and changed-elements syncs of SmolLM2 in bfloat16 after real optimizer steps."""
    import tempfile

    from transformers import AutoModelForCausalLM

    from rollflow.models import resolve_model
    from rollflow.weight_sync.buckets import pack_into

    model = AutoModelForCausalLM.from_pretrained(resolve_model("smollm2-135m-instruct"), dtype=torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    batch = torch.randint(0, model.config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(0))
    weights = model.state_dict()
    plan = plan_buckets((n, t.dtype, tuple(t.shape)) for n, t in weights.items())
    memory = torch.empty(plan.total_bytes, dtype=torch.uint8)
    senders = [GlooSender("127.0.0.1", 0, timeout_s=300) for _ in range(2)]
    out = Path(tempfile.mkdtemp(prefix="rollflow-delta-")) / "received.pt"
    child = subprocess.Popen(
        [sys.executable, __file__, "--delta-receiver", *(str(s.port) for s in senders), "--out", str(out)],
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    for sender in senders:
        sender.connect()
    full, changes = senders
    rows = []
    for step in range(updates):
        if step:
            model(batch, labels=batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        pack_into(plan, model.state_dict().items(), memory)
        _broadcast(full._group, torch.ones(1, dtype=torch.int64))
        took_full = timed(lambda: (full.send_packed(plan, memory), done(full._group)))
        took_delta = timed(lambda: (changes.send_packed(plan, memory, changes=True), done(changes._group)))
        rows.append((step, full.last_sent, took_full, changes.last_sent, took_delta))
    _broadcast(full._group, torch.zeros(1, dtype=torch.int64))
    child.wait(timeout=300)
    exact = torch.equal(torch.load(out), memory)
    print(f"SmolLM2-135M-Instruct in bfloat16, AdamW lr 1e-6, gloo over 127.0.0.1 ({plan.total_bytes / 2**20:.0f} MB)")
    print(f"{'update':>6}{'full MB':>10}{'full s':>9}{'delta MB':>10}{'delta s':>9}{'fraction':>10}")
    for step, full_bytes, full_s, delta_bytes, delta_s in rows:
        print(f"{step:>6}{full_bytes / 2**20:>10.2f}{full_s:>9.3f}{delta_bytes / 2**20:>10.2f}{delta_s:>9.3f}"
              f"{delta_bytes / full_bytes:>10.4f}")
    later = rows[1:]
    return {
        "frac": statistics.median(r[3] / r[1] for r in later),
        "exact": float(exact),
        "full_s": statistics.median(r[2] for r in later),
        "delta_s": statistics.median(r[4] for r in later),
    }


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
    parser.add_argument("--updates", type=int, default=6, help="optimizer steps of the delta part (the first: full)")
    parser.add_argument("--receiver", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--delta-receiver", type=int, nargs=2, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.receiver is not None:
        receiver(args.receiver, args.mb, args.repeats)
        return
    if args.delta_receiver is not None:
        delta_receiver(args.delta_receiver, args.out)
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
    changed = delta_part(args.updates)
    print(f"median of the updates after the first: full {changed['full_s']:.3f} s, delta {changed['delta_s']:.3f} s")
    print(machine.describe())
    print(
        f"RESULT packed_speedup={speedup:.2f} shm_vs_memcpy={memcpy / write:.2f} gloo_gbps={gloo_gbps:.2f}"
        f" delta_bytes_frac={changed['frac']:.4f} delta_exact={int(changed['exact'])}"
    )


if __name__ == "__main__":
    main()
