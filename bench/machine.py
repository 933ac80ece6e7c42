"""The machine a benchmark ran on, as one line each benchmark prints first.

These machines differ by day (CPU vendor and generation, SIMD width), and a figure means little
without its machine: the README's table and docs/benchmarks.md quote this line. Linux only; it
reads /proc and prints what it cannot find as unknown rather than guessing.
"""

from __future__ import annotations

import os
from pathlib import Path

SIMD = (("avx512f", "AVX-512"), ("avx2", "AVX2"), ("asimd", "NEON"))
"""The widest vector extension named in the CPU flags, widest first (what vLLM's CPU kernels and
oneDNN pick their code by)."""


def describe() -> str:
    """`machine: MODEL (family F model M), N cores, SIMD, G GiB`."""
    info: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, sep, value = line.partition(":")
            if sep and key.strip() not in info:
                info[key.strip()] = value.strip()
    except OSError:
        pass
    name = info.get("model name", "unknown CPU")
    if "cpu family" in info and "model" in info:
        name += f" (family {info['cpu family']} model {info['model']})"
    flags = set((info.get("flags") or info.get("Features") or "").split())
    simd = next((label for flag, label in SIMD if flag in flags), "no wide SIMD found")
    try:
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        memory = f"{pages / 2**30:.0f} GiB"
    except (ValueError, OSError):
        memory = "unknown memory"
    # The machine's cores, not this process's: some benchmarks pin themselves to one.
    return f"machine: {name}, {os.cpu_count()} cores, {simd}, {memory}"


if __name__ == "__main__":
    print(describe())
