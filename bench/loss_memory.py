"""Loss memory: chunked log-probs vs full logits, forward + backward, side by side in one run.

Each path runs in a fresh subprocess on the same inputs (hidden states and an LM head of
SmolLM2's shape: vocab 49,152, width 576; 2,048 tokens). Memory is the peak resident set
during forward + backward above what the process held just before (inputs, warm kernels);
both paths also allocate the same LM-head and hidden-state gradients (≈ 118 MB), which are
included. Prints a table and, last, `RESULT loss_memory_ratio=<chunked/naive>` for the default
chunk size.

    bin/dev python bench/loss_memory.py [--tokens 2048] [--vocab 49152] [--hidden 576]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import machine


def _rss_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def child(path: str, tokens: int, vocab: int, hidden_size: int, chunk: int) -> None:
    import torch

    from rollflow.loss import naive_token_logprobs, token_logprobs

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, hidden_size, generator=g, requires_grad=True)
    weight = (torch.randn(vocab, hidden_size, generator=g) * 0.05).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,), generator=g)
    upstream = torch.randn(tokens, generator=g)

    def run(n: int) -> None:
        if path == "naive":
            out = naive_token_logprobs(hidden[:n], weight, targets[:n])
        else:
            out, _ = token_logprobs(hidden[:n], weight, targets[:n], chunk=chunk)
        (out * upstream[:n]).sum().backward()

    run(8)  # warm up kernels and allocator outside the measurement
    hidden.grad = weight.grad = None
    base = _rss_kb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak (VmHWM) to the current RSS
    began = time.perf_counter()
    run(tokens)
    seconds = time.perf_counter() - began
    peak = _rss_kb("VmHWM")
    print(json.dumps({"extra_mb": (peak - base) / 1024, "seconds": seconds}))


def measure(path: str, args: argparse.Namespace, chunk: int) -> dict[str, float]:
    done = subprocess.run(
        [sys.executable, __file__, "--child", path, "--tokens", str(args.tokens), "--vocab", str(args.vocab),
         "--hidden", str(args.hidden), "--chunk", str(chunk)],
        capture_output=True, text=True, check=True,
        # A fixed mmap threshold makes glibc return every large buffer to the OS when freed, so
        # the resident set tracks live tensors instead of heap memory kept for reuse.
        env=dict(os.environ, OMP_NUM_THREADS=str(args.threads), MALLOC_MMAP_THRESHOLD_="131072"),
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=49_152)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--chunk", type=int, default=None)
    parser.add_argument("--child", choices=["naive", "chunked"])
    args = parser.parse_args()
    from rollflow.loss import DEFAULT_CHUNK

    if args.child:
        child(args.child, args.tokens, args.vocab, args.hidden, args.chunk or DEFAULT_CHUNK)
        return
    rows = [("naive (full logits)", measure("naive", args, 0))]
    for chunk in sorted({32, 64, DEFAULT_CHUNK, 512}):
        rows.append((f"chunked, chunk={chunk}" + (" (default)" if chunk == DEFAULT_CHUNK else ""),
                     measure("chunked", args, chunk)))
    naive = rows[0][1]
    print(f"tokens={args.tokens} vocab={args.vocab} hidden={args.hidden} float32, forward + backward")
    print(f"{'path':<28}{'peak extra MB':>15}{'seconds':>10}{'memory ratio':>14}{'time ratio':>12}")
    for name, r in rows:
        print(f"{name:<28}{r['extra_mb']:>15.0f}{r['seconds']:>10.2f}"
              f"{r['extra_mb'] / naive['extra_mb']:>14.3f}{r['seconds'] / naive['seconds']:>12.2f}")
    default = next(r for name, r in rows if "(default)" in name)
    # Both paths must materialise the LM-head and hidden-state gradients (their outputs); the
    # second figure leaves that shared floor out and compares the loss's own working memory.
    grads_mb = (args.vocab + args.tokens) * args.hidden * 4 / 2**20
    excl = (default["extra_mb"] - grads_mb) / (naive["extra_mb"] - grads_mb)
    print(f"gradient floor shared by both paths: {grads_mb:.0f} MB")
    total = default["extra_mb"] / naive["extra_mb"]
    print(machine.describe())
    print(f"RESULT loss_memory_ratio={total:.3f} loss_memory_ratio_excl_grads={excl:.3f}")


if __name__ == "__main__":
    main()
