"""The run directory: preparing it, refusing a resume that cannot work, checkpoints in and out.

`Outputs` opens the files a run writes as it goes (metrics, ledger, sinks, the trace) and closes
them. `prepare_output_dir` checks the output directory for a new run, or finds the checkpoint a
resumed run continues from (refusing changed settings the checkpoint depends on) and cuts the
ledger and metrics back to it. `Checkpointer` decides when a periodic checkpoint is due and
writes one (`rollflow.checkpoint` makes the write atomic) on the trainer thread, so the trainer
is between steps while its tensors are saved. What goes into `RunState` is assembled by the
controller, which knows every component; this module owns no run state itself.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from pathlib import Path

import msgspec

from rollflow.checkpoint import (
    CHECKPOINTS,
    RESUME_FIXED,
    RunState,
    clean_temporary,
    latest_checkpoint,
    read_state,
    resume_changes,
    save_checkpoint,
)
from rollflow.config import Config, load_config
from rollflow.controller.trainer_thread import TrainerRunner
from rollflow.errors import ConfigError, UserInputError
from rollflow.ledger import LEDGER, truncate
from rollflow.metrics import ConsoleSink, JsonlSink, LoopLag, MetricsSink, make_sinks
from rollflow.rundir import STATUS, read_status
from rollflow.trace import Trace

log = logging.getLogger(__name__)

METRICS = "metrics.jsonl"


class Outputs:
    """The files a run writes as it goes, open for its lifetime."""

    def __init__(self, output_dir: Path, config: Config, began: float) -> None:
        observe = config.observe
        self.output_dir = output_dir
        self.write_trace = observe.trace
        self.trace = Trace(observe.trace_max_events, began=began)
        self.loop_lag = LoopLag(observe.loop_probe_s, block_warn_s=observe.loop_block_warn_s)
        self.metrics = JsonlSink(output_dir / METRICS)
        self.ledger = JsonlSink(output_dir / LEDGER)
        self.sinks: list[MetricsSink] = [self.metrics]
        """Every sink a step's metrics go to, `metrics.jsonl` first."""
        self.sinks += make_sinks(
            observe.sinks,
            output_dir,
            total_steps=config.run.max_steps,
            project=observe.wandb_project,
            mode=observe.wandb_mode,
            config=msgspec.to_builtins(config),
        )
        self.console = next((s for s in self.sinks if isinstance(s, ConsoleSink)), None)

    def waiting(self, what: str) -> None:
        """Tell the console what the run waits for."""
        if self.console is not None:
            self.console.waiting(what)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
        self.ledger.close()
        if self.write_trace:
            self.trace.write(self.output_dir / "trace.json")


ATTEMPTS = "attempts"
"""Where the logs of a run that ended without a checkpoint are kept when it is started over."""


def prepare_output_dir(out: Path, config: Config, *, resume: bool) -> tuple[Path, RunState] | None:
    """Check `out` for a new or a resumed run; returns the checkpoint to resume from and its
    state. On resume, the ledger and metrics are cut back to the checkpoint. A run here that
    ended without a checkpoint and without finishing (killed before its first checkpoint, or
    failed with checkpoints off; its status.json says so) cannot be continued: the same command,
    with or without `--resume`, starts it over, its earlier logs kept under `attempts/N/`."""
    existing = [n for n in (METRICS, LEDGER) if (out / n).exists()]
    checkpoint = latest_checkpoint(out)
    if checkpoint is None and existing:
        status = read_status(out)
        trained = _steps_logged(out)
        if trained and (status is None or status.state == "finished"):  # finished, or not a run rollflow knows
            raise UserInputError(
                f"{out}: already holds a run ({', '.join(existing)}) with no checkpoint to continue from; "
                "choose a new output directory"
            )
        if trained:
            kept = _set_aside(out)
            log.warning(
                "%s: the run here ended after training without a checkpoint; starting it over (its logs "
                "are kept in %s)",
                out,
                kept,
            )
        else:  # it ended before its first step: nothing was trained
            log.warning("%s: the run here ended before its first step; starting it from the beginning", out)
            for name in existing:
                (out / name).unlink()
        existing = []
        resume = False
    if not resume:
        if existing:
            raise UserInputError(
                f"{out}: already holds a run ({', '.join(existing)}); resume it with --resume or choose a new "
                "output directory"
            )
        out.mkdir(parents=True, exist_ok=True)
        return None
    if checkpoint is None:
        raise UserInputError(f"{out}: no checkpoint to resume from in {out / CHECKPOINTS}; start without --resume")
    check_resumable(out / "config.toml", config)
    clean_temporary(out)
    state = read_state(checkpoint)
    if state.step >= config.run.max_steps:
        raise UserInputError(
            f"{checkpoint}: the run already did {state.step} steps (run.max_steps = {config.run.max_steps}); "
            "raise --max-steps to train further"
        )
    truncate(out / LEDGER, state.ledger_bytes)
    truncate(out / METRICS, state.metrics_bytes)
    log.info("resuming from %s (step %d)", checkpoint, state.step)
    return checkpoint, state


def _set_aside(out: Path) -> Path:
    """Move a run's logs (and its trace and status) into a new `attempts/N/`; returns it."""
    attempts = out / ATTEMPTS
    attempts.mkdir(exist_ok=True)
    n = 1 + max((int(p.name) for p in attempts.iterdir() if p.name.isdigit()), default=0)
    kept = attempts / str(n)
    kept.mkdir()
    for name in (METRICS, LEDGER, "trace.json", "config.toml", STATUS):
        if (out / name).exists():
            (out / name).rename(kept / name)
    return kept


def _steps_logged(out: Path) -> bool:
    """Whether the run in `out` trained anything (a metrics row, or a prompt trained in the ledger)."""
    metrics, ledger = out / METRICS, out / LEDGER
    if metrics.exists() and metrics.stat().st_size > 0:
        return True
    if not ledger.exists():
        return False
    with ledger.open("rb") as lines:
        return any(_outcome(line) in ("trained", "unreadable") for line in lines)


def _outcome(line: bytes) -> str:
    try:
        return str(msgspec.json.decode(line).get("outcome", ""))
    except (msgspec.DecodeError, AttributeError):
        return "unreadable"  # counts as something there: never thrown away


def check_resumable(saved: Path, config: Config) -> None:
    """Refuse to resume with settings the checkpoint depends on changed (`RESUME_FIXED`)."""
    if not saved.exists():
        log.warning("%s is missing: cannot check that the resumed run's settings match", saved)
        return
    try:
        previous = load_config(saved)
    except ConfigError as err:
        log.warning("cannot check the resumed run's settings against %s: %s", saved, err)
        return
    changes = resume_changes(previous, config)
    if changes:
        raise UserInputError(
            f"{saved}: cannot resume this run with different {', '.join(RESUME_FIXED)} settings; changed: "
            + "; ".join(changes)
            + ". Put them back, or start a new run in another output directory"
        )


class Checkpointer:
    """When to checkpoint, and writing one."""

    def __init__(
        self,
        output_dir: Path,
        config: Config,
        runner: TrainerRunner,
        *,
        logs: list[JsonlSink],
        trace: Trace,
        clock: Callable[[], float],
    ) -> None:
        self.output_dir = output_dir
        self.logs = logs
        """Files whose lengths a checkpoint records: on disk before the checkpoint is committed."""
        self.enabled = config.checkpoint.enabled
        self.every = config.checkpoint.every if self.enabled else 0
        self.every_s = config.checkpoint.every_s if self.enabled else 0.0
        self.keep_last = config.checkpoint.keep_last
        self.max_steps = config.run.max_steps
        self.runner = runner
        self.trace = trace
        self.clock = clock
        self.last: Path | None = None
        """The last checkpoint written."""
        self.last_at = clock()
        """When the last checkpoint was written (or the run started)."""
        self.last_step = 0
        """The step count of the last checkpoint written or restored."""

    def due(self, steps_done: int) -> bool:
        """A periodic checkpoint is due after `steps_done` steps (the final one is written apart)."""
        by_steps = bool(self.every) and steps_done % self.every == 0
        by_time = bool(self.every_s) and self.clock() - self.last_at >= self.every_s
        return (by_steps or by_time) and steps_done < self.max_steps

    async def save(self, state: RunState) -> Path:
        """Write `state` and the trainer's tensors as the checkpoint of step `state.step`."""
        began = self.clock()
        backend = self.runner.backend

        def write() -> Path:
            for log_file in self.logs:  # the lengths the state records are on disk first
                log_file.fsync()
            return save_checkpoint(self.output_dir, state, backend.save, step=state.step, keep_last=self.keep_last)

        path = await self.runner.call(write)
        self.trace.span("checkpoint", "trainer", began, self.clock(), step=state.step, path=path.name)
        self.last, self.last_at, self.last_step = path, self.clock(), state.step
        log.info("checkpoint %s written in %.1f s", path, self.clock() - began)
        return path

    async def export_final(self, base: Path, *, lora: bool) -> Path:
        """Write the trained policy to `final/` as a Hugging Face folder on the base model
        `base` (a LoRA run: its peft adapter folder), on the trainer thread (with several ranks the
        gathers are collectives; rank 0 writes)."""
        from rollflow.export import FINAL, write_adapter, write_model

        began = self.clock()
        backend, out = self.runner.backend, self.output_dir / FINAL

        def write() -> Path:
            if lora:
                return write_adapter(out, base, backend.adapter_weights(), backend.adapter_config())
            return write_model(out, base, dict(backend.full_weights()))

        path = await self.runner.call(write)
        self.trace.span("export", "trainer", began, self.clock(), path=path.name)
        log.info("trained policy written to %s in %.1f s", path, self.clock() - began)
        return path

    async def after_error(self, steps_done: int, in_step: bool, save: Callable[[int], Awaitable[Path]]) -> None:
        """An error ends the run: `save` the steps trained since the last checkpoint, if the
        trainer is between steps (inside a step or its weight publish, its weights are not known
        to match a step count, and nothing is written)."""
        if not self.enabled or in_step or steps_done <= self.last_step:
            return
        try:
            saved = await save(steps_done)
        except Exception as err:  # the run's own error is the one to report
            log.error("after the error, no checkpoint could be written: %s: %s", type(err).__name__, err)
            return
        log.error("the run failed after %d steps; they are saved in %s (--resume continues)", steps_done, saved)

    async def restore(self, checkpoint: Path, state: RunState) -> None:
        """Load the trainer's tensors and state from `checkpoint`."""
        path = checkpoint / "trainer"
        backend = self.runner.backend
        await self.runner.call(lambda: backend.load(path, state.trainer))
        self.runner.steps_run = self.last_step = state.step
