"""What the engine benchmarks share: their command line and their side-by-side table."""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import time
from collections.abc import Awaitable, Callable, Iterator

import machine

from rollflow.engine import EngineOutput
from rollflow.records import SamplingSpec
from rollflow.testing import FakeEngine


def engine_args(doc: str, rounds: int = 6, switches: dict[str, str] | None = None) -> argparse.Namespace:
    """--requests, --tokens, --rounds, --model: concurrent rollouts of fixed length, per round;
    `switches`: the benchmark's own on/off flags (flag -> its help)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--model", default="tiny")
    for flag, text in (switches or {}).items():
        parser.add_argument(flag, action="store_true", help=text)
    return parser.parse_args()


def report(totals: dict[str, list], ratios: list[float], args: argparse.Namespace, result: str) -> None:
    """Tokens, seconds and tokens/s per path, the per-round ratios, and the RESULT line (their
    median, which resists the machine's noise better than the ratio of totals)."""
    width = max(len(name) for name in totals) + 2
    print(f"{'path':<{width}}{'tokens':>10}{'seconds':>10}{'tokens/s':>12}")
    for name, (tokens, seconds) in totals.items():
        print(f"{name:<{width}}{tokens:>10}{seconds:>10.2f}{tokens / seconds:>12.0f}")
    print("per-round ratios: " + " ".join(f"{r:.3f}" for r in ratios))
    print(f"requests={args.requests} tokens/request={args.tokens} rounds={args.rounds} model={args.model}")
    print(machine.describe())
    print(f"RESULT {result}={statistics.median(ratios):.3f}")


async def alternate(
    paths: list[tuple[str, Callable[[str], Awaitable[int]]]], rounds: int
) -> tuple[dict[str, list], list[float]]:
    """Run each path's round (tag -> tokens made) once per round, alternating which goes first
    so neither always runs on a warmer engine. Returns the totals ([tokens, seconds] per path)
    and, per round, the second path's tokens/s over the first's.

    The rounds run with the startup heap kept out of the collector (`frozen_heap`)."""
    totals: dict[str, list] = {name: [0, 0.0] for name, _ in paths}
    ratios: list[float] = []
    rate: dict[str, float] = {}
    with frozen_heap():
        for r in range(rounds):
            for name, run in paths if r % 2 == 0 else paths[::-1]:
                began = time.perf_counter()
                tokens = await run(f"{name[:2]}{r}")
                seconds = time.perf_counter() - began
                totals[name][0] += tokens
                totals[name][1] += seconds
                rate[name] = tokens / seconds
            ratios.append(rate[paths[1][0]] / rate[paths[0][0]])
    return totals, ratios


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Keep the objects that exist now out of the cyclic garbage collector meanwhile, as a run
    keeps its startup heap (`run.gc_freeze`): otherwise a full collection of vLLM's, torch's and
    transformers' objects (about 0.5 s on a 2-core machine) lands in one round of one path or the
    other and decides that round's figure."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def workload(args: argparse.Namespace) -> tuple[list[list[int]], SamplingSpec]:
    """`args.requests` short prompts, each sampled for exactly `args.tokens` tokens."""
    prompts = [[1, 100 + i, 202, 276, 261, 264, 277] for i in range(args.requests)]
    return prompts, SamplingSpec(temperature=1.0, max_tokens=args.tokens, ignore_eos=True)


class InstantEngine(FakeEngine):
    """Zero latency: every request returns a fixed completion in one final output, at once."""

    def __init__(self, tokens: int) -> None:
        super().__init__()
        self.tokens = list(range(3, 3 + tokens))
        self.logprobs = [-1.0] * tokens

    async def stream(self, request_id, prompt_token_ids, sampling, *, deltas=True):
        n = min(sampling.max_tokens, len(self.tokens))
        yield EngineOutput(self.tokens[:n], self.logprobs[:n], "length", [self.version] * n)

    async def update_weights_with(self, load, *, partial="keep", deadline_s=None, version=None):
        await load()
        self._version = self._version + 1 if version is None else version
        return self._version

    def partial(self, request_id):
        return None  # a request never runs long enough to be seen mid-way
