"""Weight update cost: each part of the engine's critical section beside a memcpy of the same bytes.

For each model (the tiny one and SmolLM2-135M-Instruct) and each `engine.linear_layout`
(`packed`, vLLM's own; `plain`; `staged`), a live vLLM engine generates a few requests while the
trainer side stages a full set of weights in the default `shm` transport and publishes it,
`--rounds` times; beside each update, a call to the engine core that does nothing (the floor any
engine-core call pays). The engine reports the seconds of its one engine-core call as the
trainer side sees it (`update`: the way to the engine core, the wait for the model step in
progress, then the load, the version label and the prefix-cache reset, and the way back), the
same call's seconds inside the engine core (`engine core`: the critical section, in which no
model step runs) and of each part; with `staged`, also the seconds the load was staged before
that call while the engine kept generating (`stage`). Beside it: a memcpy of the same bytes in
this process (the ratio: `update` over the memcpy), and the engine's generation speed in that
layout (16 greedy requests), alone and
while the trainer side publishes back to back (`updating`: tokens streamed in 15 s), since the
layout trades one against the other. Then the tiny preset trains synchronously (`max_lag = 0`)
in `packed` and `plain`, and the share of its step wall time that is neither generating nor
training is measured from its metrics.

Each round also makes a checked update, as a training run does (the weight-sync fingerprint,
`rollflow.engine.fingerprint`), and a second table gives its parts and `cost`: the fingerprint's
work on the trainer side and the worker's, over the whole unchecked update.

Prints a table of median milliseconds and, last, `RESULT check_cost_frac_tiny=F check_cost_frac_smollm2=G
update_vs_memcpy_tiny=X
update_vs_memcpy_smollm2=Y update_vs_memcpy_smollm2_packed=K update_vs_memcpy_smollm2_plain=P
update_ms_tiny=T engine_core_ms_tiny=C idle_noop_ms_tiny=I sync_overhead_frac=Z sync_update_ms_tiny=U
sync_step_packed_vs_plain=R` (each model in the layout its preset uses: tiny plain, SmolLM2 staged;
and SmolLM2's others; T: the whole update with requests generating, as the trainer side waits
for it, C: its time in the engine core; I: the do-nothing engine-core call to the idle tiny
engine, vLLM's IPC alone; Z and U in the tiny preset's layout, U: the weight update a synchronous
step waits for (`engine_update_s`, the engine idle); R: the synchronous step's time in `packed`
over `plain`; `--sync-runs 0` leaves Z, U and R out).

    bin/dev python bench/weight_update.py [--rounds 8] [--models tiny,smollm2-135m-instruct] [--steps 12]
        [--sync-runs 3] [--layouts packed,plain,staged]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import statistics
import tempfile
import time
from pathlib import Path

import machine

PARTS = ("noop call", "stage", "update", "engine core", "load", "label", "reset prefix cache")
"""`noop call`: a call to the engine core that does nothing (vLLM's `get_weight_version`), the
round trip any engine-core call pays, waiting for the model step in progress included. `stage`:
the `staged` layout's load and packing on a thread of the engine process, before the call.
`update`: the update's engine-core call as this process sees it; `engine core`: the same call's
time inside the engine core, in which it runs no model step (the rest of `update` is the wait for
the step in progress and the call's way there and back, while the engine generates)."""
IDLE = "idle noop"
"""The same call to an idle engine (no request running), median of 30: vLLM's IPC alone."""
LAYOUTS = ("packed", "plain", "staged")
SYNC_LAYOUTS = ("packed", "plain")
WINDOW_S = 15.0
"""Seconds of generation counted while the trainer side publishes back to back."""
PRESET_LAYOUT = {"tiny": "plain"}
CHECK = ("checked staging", "checked update", "checked core", "trainer side", "worker side")
"""Each round also makes a checked update (`rollflow.engine.fingerprint`), as a training run does:
its staging with the fingerprint taken, its update call (the fingerprint travels in it) and its
engine-core time (the worker's read-back inside), and the fingerprint's work on each side timed
alone in this process. The check's cost: trainer side + worker side, over an unchecked update
from end to end (its staging, then the whole publish: with `staged`, the engine's stage too)."""
"""The layout each model's preset uses (others: the default, staged)."""


def memcpy_s(nbytes: int, rounds: int = 7) -> float:
    import torch

    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    times = []
    for _ in range(rounds):
        began = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - began)
    return statistics.median(times)


async def tokens_per_s(engine, requests: int = 16, max_tokens: int = 64) -> float:
    """Greedy generation speed: `requests` prompts at once, best of two rounds after a warm-up."""
    from rollflow.records import SamplingSpec

    spec = SamplingSpec(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    rates = []
    for round_ in range(3):
        began = time.perf_counter()
        outs = await asyncio.gather(
            *(engine.generate([1, 100 + i, 202, 276], spec, f"speed{round_}-{i}") for i in range(requests))
        )
        rates.append(sum(len(out.token_ids) for out in outs) / (time.perf_counter() - began))
    return max(rates[1:])


async def tokens_in_window(engine, seconds: float, requests: int = 16, max_tokens: int = 64) -> float:
    """Tokens/s that `requests` greedy streams, each restarted when it ends, get in `seconds`."""
    from rollflow.records import SamplingSpec

    spec = SamplingSpec(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    count = 0

    async def stream(i: int) -> None:
        nonlocal count
        for k in itertools.count():
            async for out in engine.stream(f"window{i}-{k}", [1, 100 + i, 202, 276], spec):
                count += len(out.token_ids)

    tasks = [asyncio.create_task(stream(i)) for i in range(requests)]
    await asyncio.sleep(seconds)
    await cancelled(tasks)
    return count / seconds


async def cancelled(tasks: list[asyncio.Task]) -> None:
    """Cancel `tasks` and wait until they have ended (their requests aborted)."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def updates(model: str, layout: str, rounds: int, requests: int) -> dict[str, float]:
    """Median seconds of the update call and its parts, the bytes of one set of weights, and
    the engine's tokens/s in this layout."""
    import torch
    from transformers import AutoModelForCausalLM

    from rollflow.config import EngineConfig
    from rollflow.engine import fingerprint
    from rollflow.engine.vllm import VLLMEngine
    from rollflow.models import resolve_model
    from rollflow.records import Prompt, SamplingSpec
    from rollflow.rollout import rollout
    from rollflow.weight_sync import ShmTransport, publish
    from rollflow.weight_sync.buckets import plan_buckets

    path = resolve_model(model)
    weights = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    plan = plan_buckets([(name, t.dtype, tuple(t.shape)) for name, t in weights.items()])
    engine = VLLMEngine(path, EngineConfig(max_num_seqs=16, linear_layout=layout))  # type: ignore[arg-type]
    transport = ShmTransport()
    await engine.start()
    idle = []
    for _ in range(30):
        began = time.perf_counter()
        await engine.llm.get_weight_version()
        idle.append(time.perf_counter() - began)
        await asyncio.sleep(0.02)
    speed = await tokens_per_s(engine)
    spec = SamplingSpec(temperature=1.0, max_tokens=256, ignore_eos=True)

    async def generating(i: int) -> None:
        for k in itertools.count():
            prompt = Prompt(id=f"p{i}", token_ids=[1, 100 + i, 202, 276])
            await rollout(engine, prompt, spec, group_id=f"g{i}-{k}", index=0)

    busy = [asyncio.create_task(generating(i)) for i in range(requests)]
    parts: dict[str, list[float]] = {name: [] for name in (*PARTS, "total", "staging")}
    checks: dict[str, list[float]] = {name: [] for name in CHECK}
    try:
        await asyncio.sleep(1.0)  # the requests are generating
        for _ in range(rounds + 1):
            began = time.perf_counter()
            await transport.stage(plan, weights.items())
            parts["staging"].append(time.perf_counter() - began)
            began = time.perf_counter()
            await engine.llm.get_weight_version()
            noop = time.perf_counter() - began
            await asyncio.sleep(0.1)
            began = time.perf_counter()
            await publish(engine, transport, plan)
            total = time.perf_counter() - began
            for name in PARTS:
                parts[name].append(engine.last_update_s.get(name, 0.0))
            parts["noop call"][-1] = noop
            parts["total"].append(total)
            await asyncio.sleep(0.2)
            await checked_update(engine, transport, plan, weights, checks, fingerprint, publish)
            await asyncio.sleep(0.2)
        await cancelled(busy)
        # Generation speed while the trainer side publishes back to back: what updates cost the
        # engine, wherever they run (a layout that stages competes for the cores instead).
        stop = asyncio.Event()

        async def updating() -> None:
            while not stop.is_set():
                await transport.stage(plan, weights.items())
                await publish(engine, transport, plan)

        publishing = asyncio.create_task(updating())
        try:
            speed_updating = await tokens_in_window(engine, WINDOW_S)
        finally:
            stop.set()
            await publishing
    finally:
        with contextlib.suppress(BaseException):
            await cancelled(busy)
        await transport.aclose()
        await engine.aclose()
    out = {name: statistics.median(values[1:]) for name, values in (parts | checks).items()}  # the first warms up
    out["bytes"] = float(plan.total_bytes)
    out["tokens/s"] = speed
    out["tokens/s updating"] = speed_updating
    out[IDLE] = statistics.median(idle)
    return out


async def checked_update(engine, transport, plan, weights, checks, fingerprint, publish) -> None:
    """One update as a training run makes it, checked: staged with the trainer side's
    fingerprint taken as the weights go by, sent with the load, read back by the worker after
    it. Notes the seconds of each part in `checks`, and of the same check's work on each side
    here (the worker's share measured on the same tensors)."""
    watcher = fingerprint.Expectation()  # the engine holds float32, as the trainer
    began = time.perf_counter()
    await transport.stage(plan, watcher.watch(weights.items()))
    checks["checked staging"].append(time.perf_counter() - began)
    await publish(engine, transport, plan, expect=watcher.fingerprint)
    checks["checked update"].append(engine.last_update_s.get("update", 0.0))
    checks["checked core"].append(engine.last_update_s.get("engine core", 0.0))
    began = time.perf_counter()
    fingerprint.of(weights.items())
    checks["trainer side"].append(time.perf_counter() - began)
    began = time.perf_counter()
    fingerprint.mismatches(watcher.fingerprint, weights.items())
    checks["worker side"].append(time.perf_counter() - began)


async def synchronous(steps: int, layout: str) -> dict[str, float]:
    """The synchronous tiny preset in `layout`, steady steps (the first is left out): seconds of
    a step, of its generating, training and weight update, and the share of the step's wall
    time that is neither generating nor training."""
    from rollflow.config import load_config
    from rollflow.controller import train

    config = load_config(
        preset="tiny",
        overrides=[
            "run.max_lag=0",
            f"run.max_steps={steps}",
            "run.eval_prompts=0",
            "checkpoint.final_model=false",
            f"engine.linear_layout={layout}",
        ],
    )
    with tempfile.TemporaryDirectory() as out:
        result = await train(config, Path(out))
    first, last = result.metrics[0], result.metrics[-1]
    wall = last["wall_s"] - first["wall_s"]
    busy = last["engine_busy_s"] - first["engine_busy_s"]
    trained = sum(m["train_step_s"] for m in result.metrics[1:])
    updated = sum(m["engine_update_s"] for m in result.metrics[1:])
    n = steps - 1
    return {"step": wall / n, "generate": busy / n, "train": trained / n, "update": updated / n,
            "overhead_frac": (wall - busy - trained) / wall}


async def main(args: argparse.Namespace) -> None:
    rows = {}
    for model in args.models.split(","):
        for layout in args.layouts.split(","):
            row = await updates(model, layout, args.rounds, args.requests)
            row["memcpy"] = memcpy_s(int(row["bytes"]))
            rows[(model, layout)] = row
    runs: dict[str, list[dict[str, float]]] = {layout: [] for layout in SYNC_LAYOUTS}
    for _ in range(args.sync_runs):  # alternating, so a slow minute of the machine hits both
        for layout in SYNC_LAYOUTS:
            runs[layout].append(await synchronous(args.steps, layout))
    sync = {
        layout: {name: statistics.median(r[name] for r in rs) for name in rs[0]} for layout, rs in runs.items() if rs
    }
    print(f"median ms over {args.rounds} updates, {args.requests} requests generating; update = the one engine call")
    columns = (IDLE, *PARTS, "total", "memcpy")
    print(
        f"{'model':<24}{'layout':>8}{'MB':>8}"
        + "".join(f"{name:>20}" for name in columns)
        + f"{'ratio':>8}{'tokens/s':>10}{'updating':>10}"
    )
    for (model, layout), r in rows.items():
        print(
            f"{model:<24}{layout:>8}{r['bytes'] / 2**20:>8.1f}"
            + "".join(f"{r[name] * 1e3:>20.2f}" for name in columns)
            + f"{r['update'] / r['memcpy']:>8.1f}{r['tokens/s']:>10.0f}{r['tokens/s updating']:>10.0f}"
        )
    print("the weight-sync check (rollflow.engine.fingerprint), median ms; cost = its share of an update")
    print(f"{'model':<24}{'layout':>8}" + "".join(f"{name:>17}" for name in ("staging", "total", *CHECK)) + "    cost")
    for (model, layout), r in rows.items():
        cost = (r["trainer side"] + r["worker side"]) / (r["staging"] + r["total"])
        r["check cost"] = cost
        shown = "".join(f"{r[name] * 1e3:>17.2f}" for name in ("staging", "total", *CHECK))
        print(f"{model:<24}{layout:>8}{shown}{cost:>8.3f}")
    parts = []
    for (model, layout), r in rows.items():
        short = model.split("-")[0]
        if layout == PRESET_LAYOUT.get(model, "staged"):
            parts.append(f"check_cost_frac_{short}={r['check cost']:.3f}")
        if layout == PRESET_LAYOUT.get(model, "staged"):
            parts.append(f"update_vs_memcpy_{short}={r['update'] / r['memcpy']:.1f}")
        elif model != "tiny":
            parts.append(f"update_vs_memcpy_{short}_{layout}={r['update'] / r['memcpy']:.1f}")
    if ("tiny", "plain") in rows:
        tiny = rows[("tiny", "plain")]
        parts.append(
            f"update_ms_tiny={tiny['total'] * 1e3:.1f} engine_core_ms_tiny={tiny['engine core'] * 1e3:.1f}"
            f" idle_noop_ms_tiny={tiny[IDLE] * 1e3:.1f}"
        )
    if sync:  # --sync-runs 0 leaves it out
        print(f"synchronous tiny preset, {args.steps - 1} steady steps, median of {args.sync_runs} runs, ms a step:")
        names = ("step", "generate", "train", "update")
        print(f"{'layout':<10}" + "".join(f"{name:>10}" for name in names) + "  overhead")
        for layout, r in sync.items():
            row = "".join(f"{r[name] * 1e3:>10.1f}" for name in names)
            print(f"{layout:<10}{row}  {r['overhead_frac']:.3f}")
        preset = sync[PRESET_LAYOUT["tiny"]]
        ratio = sync["packed"]["step"] / sync["plain"]["step"]
        parts.append(
            f"sync_overhead_frac={preset['overhead_frac']:.3f} sync_update_ms_tiny={preset['update'] * 1e3:.1f}"
            f" sync_step_packed_vs_plain={ratio:.2f}"
        )
    print(machine.describe())
    print("RESULT " + " ".join(parts))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--models", default="tiny,smollm2-135m-instruct")
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--steps", type=int, default=12, help="steps of the synchronous tiny run")
    parser.add_argument("--sync-runs", type=int, default=3, help="synchronous runs per layout, alternating")
    asyncio.run(main(parser.parse_args()))
