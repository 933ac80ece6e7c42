"""Per-step metrics on their way out: the `MetricsSink` Protocol, its sinks, and loop lag.

A metrics row is one dict per optimizer step (see the README for its keys); values are numbers,
or dicts of numbers for histograms and per-reason counts (`lag_hist`, `unscorable_by_reason`,
...). `metrics.jsonl` always gets the row as it is; the other sinks get it flattened to
`name/key` scalars. Sinks:

- `JsonlSink`: `metrics.jsonl`, one line per step, flushed per line;
- `ConsoleSink`: the progress line (a rich progress bar on a terminal, a line per step in logs);
- `TensorBoardSink`: event files under `tensorboard/` (needs the `tensorboard` package);
- `WandbSink`: Weights & Biases, offline by default (files under `wandb/`; needs `wandb`).

`LoopLag` measures how late the event loop runs a timer: the number that says whether anything
is blocking the loop that streams tokens. This module computes no training metrics itself.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal, Protocol

import msgspec

from rollflow.errors import UserInputError

log = logging.getLogger(__name__)


class MetricsSink(Protocol):
    def write(self, row: dict[str, Any]) -> None:
        """Take one step's metrics."""
        ...

    def close(self) -> None: ...


def flatten(row: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """Numbers of a (nested) row as `a/b` scalars; anything else is left out."""
    flat: dict[str, float] = {}
    for key, value in row.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, f"{name}/"))
        elif isinstance(value, int | float):  # bool included
            flat[name] = float(value)
    return flat


def histogram(values: Iterable[int]) -> dict[str, int]:
    """Counts per value, keys as strings in increasing order (JSON object keys)."""
    counts: dict[int, int] = {}
    for v in values:
        counts[v] = counts.get(v, 0) + 1
    return {str(k): counts[k] for k in sorted(counts)}


class JsonlSink:
    """Append-only JSON lines, flushed per line (a crash loses at most the line being written)."""

    def __init__(self, path: Path) -> None:
        self._file = path.open("ab")

    def write(self, row: Any) -> None:
        self._file.write(msgspec.json.encode(row) + b"\n")
        self._file.flush()

    def position(self) -> int:
        """The file's length in bytes with every line written so far (what a checkpoint records;
        `fsync` before the checkpoint is committed puts them on disk)."""
        self._file.flush()
        return self._file.tell()

    def fsync(self) -> None:
        """Force the lines written so far to disk (blocking: call it off the event loop)."""
        os.fsync(self._file.fileno())

    def close(self) -> None:
        self._file.close()


class ConsoleSink:
    """The live progress line: step, reward, lag, idle and throughput."""

    def __init__(self, total_steps: int, *, stream: Any = None) -> None:
        from rich.console import Console

        self.total = total_steps
        self.console = Console(file=stream or sys.stderr, highlight=False, soft_wrap=True)
        self._progress: Any = None
        if self.console.is_terminal:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._progress = Progress(
                TextColumn("step"),
                MofNCompleteColumn(),
                BarColumn(),
                TimeElapsedColumn(),
                TextColumn("{task.description}"),
                console=self.console,
            )
            self._task = self._progress.add_task("starting", total=total_steps)
            self._progress.start()

    @staticmethod
    def line(row: dict[str, Any]) -> str:
        return (
            f"reward {row['reward_mean']:.3f}  lag {row['lag_mean']:.2f} (max {row['lag_max']})"
            f"  ratio {row.get('ratio_mean', 1.0):.4f}  trainer idle {row['trainer_idle_frac']:.0%}"
            f"  engine idle {row['engine_idle_frac']:.0%}  {row['gen_tokens_per_s']:.0f} tok/s"
            f"  sync {row['weight_sync_s']:.2f}s"
        )

    def waiting(self, what: str) -> None:
        """Say what the run is waiting for (starting the engine, an evaluation, a checkpoint)."""
        if self._progress is not None:
            self._progress.update(self._task, description=f"{what} ...")
        else:
            self.console.print(f"{what} ...")

    def write(self, row: dict[str, Any]) -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=row["step"] + 1, description=self.line(row))
        else:
            self.console.print(f"step {row['step'] + 1}/{self.total}  {self.line(row)}")

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()


class TensorBoardSink:
    """Scalars into TensorBoard event files (`tensorboard --logdir DIR/tensorboard`)."""

    def __init__(self, log_dir: str | Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise UserInputError(
                "observe.sinks: `tensorboard` needs the tensorboard package (pip install 'rollflow[tensorboard]')"
            ) from None
        self._writer = SummaryWriter(log_dir=str(log_dir))

    def write(self, row: dict[str, Any]) -> None:
        step = int(row["step"])
        for name, value in flatten(row).items():
            if name != "step":
                self._writer.add_scalar(name, value, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    """Weights & Biases: one run per training run; offline mode writes under `dir/wandb`."""

    def __init__(
        self, directory: str | Path, *, project: str, mode: Literal["offline", "online"], config: dict[str, Any]
    ) -> None:
        try:
            import wandb
        except ImportError:
            raise UserInputError(
                "observe.sinks: `wandb` needs the wandb package (pip install 'rollflow[wandb]')"
            ) from None
        self._run = wandb.init(
            project=project,
            mode=mode,
            dir=str(directory),
            config=config,
            reinit="create_new",
            settings=wandb.Settings(silent=True, console="off"),
        )

    def write(self, row: dict[str, Any]) -> None:
        self._run.log({k: v for k, v in flatten(row).items() if k != "step"}, step=int(row["step"]))

    def close(self) -> None:
        self._run.finish()


def make_sinks(
    names: Iterable[str],
    output_dir: Path,
    *,
    total_steps: int,
    project: str = "rollflow",
    mode: Literal["offline", "online"] = "offline",
    config: dict[str, Any] | None = None,
) -> list[MetricsSink]:
    """The configured sinks (`metrics.jsonl`, always written, is the caller's `JsonlSink`)."""
    sinks: list[MetricsSink] = []
    for name in names:
        if name == "console":
            sinks.append(ConsoleSink(total_steps))
        elif name == "tensorboard":
            sinks.append(TensorBoardSink(output_dir / "tensorboard"))
        elif name == "wandb":
            sinks.append(WandbSink(output_dir, project=project, mode=mode, config=config or {}))
        else:
            raise UserInputError(f"observe.sinks: unknown sink {name!r}; expected console, tensorboard or wandb")
    return sinks


class LoopLag:
    """Samples how late the event loop fires a timer every `every_s` seconds, and, from a
    watchdog thread, reports a loop blocked for `block_warn_s` with the code it is stuck in."""

    def __init__(self, every_s: float = 0.05, *, block_warn_s: float = 0.0) -> None:
        self.every_s = every_s
        self.block_warn_s = block_warn_s
        self._lags: list[float] = []
        self._beat = time.monotonic()
        """When the loop last fired the probe's timer (read by the watchdog thread)."""

    async def run(self) -> None:
        """Sample until cancelled."""
        loop = asyncio.get_running_loop()
        stop = threading.Event()
        if self.block_warn_s > 0:
            watchdog = threading.Thread(
                target=self._watch, args=(threading.get_ident(), stop), name="rollflow-loop-watchdog", daemon=True
            )
            watchdog.start()
        try:
            while True:
                due = loop.time() + self.every_s
                self._beat = time.monotonic()
                await asyncio.sleep(self.every_s)
                self._lags.append(max(0.0, loop.time() - due))
        finally:
            stop.set()

    def _watch(self, loop_thread: int, stop: threading.Event) -> None:
        reported = None
        while not stop.wait(min(0.5, self.block_warn_s / 4)):
            beat = self._beat
            blocked = time.monotonic() - beat - self.every_s
            if blocked < self.block_warn_s or reported == beat:
                continue
            reported = beat  # once per stall
            frame = sys._current_frames().get(loop_thread)
            where = "; ".join(
                f"{Path(f.filename).name}:{f.lineno} in {f.name}" for f in traceback.extract_stack(frame)[-3:]
            )
            log.warning(
                "the event loop has been blocked for %.1f s, so nothing else in the run moves; it is in %s. "
                "A blocking call inside async code (time.sleep, synchronous IO)? Run it with asyncio.to_thread",
                blocked,
                where or "unknown code",
            )

    def take(self) -> dict[str, float]:
        """Mean and max lag (ms) since the last call."""
        lags, self._lags = self._lags, []
        if not lags:
            return {"loop_lag_ms_mean": 0.0, "loop_lag_ms_max": 0.0}
        return {"loop_lag_ms_mean": 1e3 * sum(lags) / len(lags), "loop_lag_ms_max": 1e3 * max(lags)}
