"""Profiles from measurements, and how well they reproduce what was measured.

A calibrated simulation needs the engine's decode step time over batch sizes (measured by a
microbenchmark: `engine_profile`), the trainer's time per model token and the weight-sync times
(`trainer_profile`), the run's completion lengths, and how much engine and trainer slow each
other down on a shared host; `fit_to_run` then sets the level of both costs to what a real
synchronous run spent (their shapes stay the microbenchmarks'). `Calibration` holds all of it
with the errors measured when it was made: the simulation of the run it was fitted on against
that run (`replay`), and of another configuration against a run of it (`predicted`), so a
prediction made with it (`rollflow simulate --profile FILE`) says how far to trust it. Saved and
loaded as JSON. This module runs nothing; `bench/simulator_validation.py` measures.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import msgspec

from rollflow.plots import lag_histogram
from rollflow.sim.components import EngineProfile, TrainerProfile
from rollflow.trainer.batches import Layout


def _steady(metrics: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A run's steps without its first (which pays for warming up), unless it has only one."""
    return metrics[1:] or metrics


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares y = a + b·x; returns (a, b). With one distinct x, the line through the origin."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    spread = sum((x - mx) ** 2 for x in xs)
    if spread == 0:
        return 0.0, my / mx if mx else 0.0
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / spread
    return my - b * mx, b


def engine_profile(
    steps: dict[int, float], *, prefill_per_token_s: float, max_num_seqs: int, contended: float = 1.0
) -> EngineProfile:
    """The engine profile of measured decode step seconds by batch size (`step_table`)."""
    table = tuple(sorted(steps.items()))
    fixed, per_seq = fit_line([float(b) for b, _ in table], [s for _, s in table])
    return EngineProfile(
        fixed_s=max(fixed, 0.0),
        per_seq_s=max(per_seq, 0.0),
        step_table=table,
        prefill_per_token_s=prefill_per_token_s,
        max_num_seqs=max_num_seqs,
        contended=contended,
    )


def trainer_profile(
    metrics: list[dict[str, Any]],
    *,
    layout: Layout,
    micro_batch_tokens: int,
    contended: float = 1.0,
    contended_batch: int = 0,
    step: tuple[float, float] | None = None,
) -> TrainerProfile:
    """The trainer profile of a run's steady steps (its first step left out): the weight-sync
    times (the trainer's staging wait, the engine's load) and, unless `step` gives them (fixed
    seconds, seconds per model token, measured on batches of different sizes), the step time
    fitted against the steps' `model_tokens`."""
    steady = _steady(metrics)
    if step is not None:
        fixed, per_token = step
    else:
        tokens = [float(m["model_tokens"]) for m in steady]
        times = [float(m["train_step_s"]) for m in steady]
        fixed, per_token = fit_line(tokens, times)
        if per_token <= 0 or fixed < 0:  # too little spread in batch sizes to split the two
            fixed, per_token = 0.0, sum(times) / sum(tokens)
    weight_bytes = int(steady[0]["weight_sync_bytes"])
    stage_s = sum(m["weight_sync_s"] for m in steady) / len(steady)
    load_s = sum(m["engine_update_s"] for m in steady) / len(steady)
    return TrainerProfile(
        s_per_token=per_token,
        layout=layout,
        micro_batch_tokens=micro_batch_tokens,
        fixed_s=fixed,
        weight_bytes=weight_bytes,
        stage_bytes_per_s=weight_bytes / max(stage_s, 1e-6),
        sync_bytes_per_s=weight_bytes / max(load_s, 1e-6),
        snapshots=True,
        contended=contended,
        contended_batch=contended_batch,
    )


def scaled_engine(profile: EngineProfile, factor: float) -> EngineProfile:
    """The same engine `factor` times slower in every step (its shape over batch sizes kept)."""
    return replace(
        profile,
        fixed_s=profile.fixed_s * factor,
        per_seq_s=profile.per_seq_s * factor,
        step_table=tuple((batch, seconds * factor) for batch, seconds in profile.step_table),
        per_context_token_s=profile.per_context_token_s * factor,
        prefill_per_token_s=profile.prefill_per_token_s * factor,
    )


def fit_to_run(
    engine: EngineProfile,
    trainer: TrainerProfile,
    replay: Callable[[EngineProfile, TrainerProfile], list[dict[str, Any]]],
    real: list[dict[str, Any]],
    *,
    rounds: int = 5,
    tolerance: float = 0.005,
) -> tuple[EngineProfile, TrainerProfile]:
    """The profiles scaled so that `replay` (a simulation of the calibration run with them)
    spends what the run itself spent generating a batch (`batch_wait_s` of its synchronous
    steps) and training it (`train_step_s`). The microbenchmarks measure each cost's shape (over
    batch sizes, per model token); the run gives its level, the machine's speed while it ran,
    which on a shared machine moves by tens of percent within minutes."""

    def mean(metrics: list[dict[str, Any]], key: str) -> float:
        steady = _steady(metrics)
        return sum(float(m[key]) for m in steady) / len(steady)

    want_gen, want_train = mean(real, "batch_wait_s"), mean(real, "train_step_s")
    for _ in range(rounds):
        got = replay(engine, trainer)
        gen, train = mean(got, "batch_wait_s"), mean(got, "train_step_s")
        if gen <= 0 or train <= 0:
            break
        if abs(gen / want_gen - 1) < tolerance and abs(train / want_train - 1) < tolerance:
            break
        engine = scaled_engine(engine, want_gen / gen)
        factor = want_train / train
        trainer = replace(trainer, s_per_token=trainer.s_per_token * factor, fixed_s=trainer.fixed_s * factor)
    return engine, trainer


def summary(metrics: list[dict[str, Any]]) -> dict[str, float]:
    """What a run is compared on, over its steady steps (the first left out): steps per second,
    the trainer's idle share (waiting for a batch or for weight sync), mean step and generation
    rate, and the samples' mean lag by cause (in flight, in the queue: `lag_in_flight_hist`,
    `lag_in_queue_hist`)."""
    steady = _steady(metrics)

    def lag_mean(key: str) -> float:
        hist = lag_histogram(steady, key)
        count = sum(hist.values())
        return sum(lag * n for lag, n in hist.items()) / count if count else 0.0

    wall = metrics[-1]["wall_s"] - metrics[0]["wall_s"] if len(metrics) > 1 else metrics[-1]["wall_s"]
    return {
        "steps_per_s": len(steady) / wall if wall > 0 else 0.0,
        "trainer_idle": sum(m["batch_wait_s"] + m["weight_sync_s"] for m in steady) / wall if wall > 0 else 0.0,
        "train_step_s": sum(m["train_step_s"] for m in steady) / len(steady),
        "gen_tokens_per_s": sum(m["gen_tokens_per_s"] for m in steady) / len(steady),
        "lag_in_flight": lag_mean("lag_in_flight_hist"),
        "lag_in_queue": lag_mean("lag_in_queue_hist"),
    }


def admission_lag(max_lag: int, steps: int) -> float:
    """The samples' mean lag over a run's steady steps (those `summary` keeps) in closed form.

    The producer starts a sample as soon as the admission rule lets it (the samples ever started
    may not exceed (v + max_lag + 1) × B once v versions exist), so the samples step s trains
    started under version max(0, s − max_lag): their lag is min(s, max_lag), whichever of
    generation and training is slower. Groups that finish out of order, and samples that wait
    for an engine slot past an update before their first token, lag less."""
    steady = range(1, steps) if steps > 1 else range(steps)
    return sum(min(s, max_lag) for s in steady) / len(steady) if steady else 0.0


def errors(simulated: dict[str, float], real: dict[str, float]) -> dict[str, float]:
    """How a simulation misses a real run: steps/s in percent of the real figure, trainer idle in
    percentage points (a share, whose relative error means little near 0)."""
    return {
        "steps_per_s_pct": 100 * (simulated["steps_per_s"] - real["steps_per_s"]) / real["steps_per_s"],
        "trainer_idle_pts": 100 * (simulated["trainer_idle"] - real["trainer_idle"]),
    }


@dataclass
class Calibration:
    """Profiles measured on one machine, the workload they were measured with, and the errors
    the simulator made against real runs with them."""

    engine: EngineProfile
    trainer: TrainerProfile
    lengths: list[int]
    """Completion lengths of the calibration run."""
    prompt_tokens: int
    machine: str
    replay: dict[str, float] = field(default_factory=dict)
    """The calibration run simulated against itself (`errors`)."""
    predicted: dict[str, float] = field(default_factory=dict)
    """Another configuration, predicted, against a run of it (`errors`)."""

    def confidence(self) -> str:
        """One line on how far the profile's predictions can be trusted."""
        parts = []
        for name, measured in (("its calibration run", self.replay), ("another configuration", self.predicted)):
            if measured:
                parts.append(
                    f"{name} within {abs(measured['steps_per_s_pct']):.1f}% steps/s, "
                    f"{abs(measured['trainer_idle_pts']):.1f} points trainer idle"
                )
        said = "; ".join(parts) if parts else "no error measured"
        return f"calibrated on {self.machine}: reproduced {said}"

    def save(self, path: Path) -> None:
        """Write the calibration whole (a reader never sees half a file)."""
        staging = path.with_name(f".{path.name}.tmp")
        staging.write_text(json.dumps(asdict(self), indent=1) + "\n")
        os.replace(staging, path)

    @classmethod
    def load(cls, path: Path) -> Calibration:
        """The calibration in `path`, checked: every field of its type, every time and rate one
        a simulation can use (ValueError naming the field otherwise)."""
        where = f"--profile {path}"
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as err:
            raise ValueError(f"{where}: not a calibration saved by bench/simulator_validation.py ({err})") from None
        not_one = f"{where}: not a calibration saved by bench/simulator_validation.py"
        try:
            calibration = msgspec.convert(data, cls, strict=True)
        except msgspec.ValidationError as err:
            text = str(err)
            found = re.search(r" - at `\$\.?(.*)`$", text)
            if found is None:
                raise ValueError(f"{not_one} ({text})") from None
            what = text[: found.start()]
            what = what[0].lower() + what[1:] if what else what
            raise ValueError(f"{where}: {found.group(1) or 'the file'}: {what}") from None
        problem = calibration.problem()
        if problem is not None:
            raise ValueError(f"{where}: {problem}")
        return calibration

    def problem(self) -> str | None:
        """Why a simulation cannot use this calibration (a negative, infinite or missing time), or None."""
        engine, trainer = self.engine, self.trainer
        for name in ("fixed_s", "per_seq_s", "per_context_token_s", "prefill_per_token_s"):
            if not 0 <= getattr(engine, name) < math.inf:
                return f"engine.{name}: expected 0 or more, got {getattr(engine, name)}"
        for i, (batch, seconds) in enumerate(engine.step_table):
            if batch < 1 or not 0 < seconds < math.inf:
                return f"engine.step_table[{i}]: [{batch}, {seconds}]: expected a batch >= 1 and a positive time"
        if not engine.step_table and engine.fixed_s + engine.per_seq_s <= 0:
            return "engine: a decode step takes no time (fixed_s and per_seq_s are 0, and no step_table)"
        if engine.max_num_seqs < 1 or not 0 < engine.contended < math.inf:
            got = f"{engine.max_num_seqs}, {engine.contended}"
            return f"engine: expected max_num_seqs >= 1 and contended > 0, got {got}"
        for name in ("s_per_token", "fixed_s", "sync_fixed_s"):
            if not 0 <= getattr(trainer, name) < math.inf:
                return f"trainer.{name}: expected 0 or more, got {getattr(trainer, name)}"
        if trainer.s_per_token == 0 and trainer.fixed_s == 0:
            return "trainer: a step takes no time (s_per_token and fixed_s are 0)"
        if not 0 < trainer.delta_fraction <= 1:
            return f"trainer.delta_fraction: expected a share of the bytes in (0, 1], got {trainer.delta_fraction}"
        for name in ("stage_bytes_per_s", "sync_bytes_per_s", "delta_scan_bytes_per_s", "contended"):
            if not getattr(trainer, name) > 0:
                return f"trainer.{name}: expected a positive number, got {getattr(trainer, name)}"
        if trainer.contended_batch < 0:
            return f"trainer.contended_batch: expected 0 or more requests, got {trainer.contended_batch}"
        if trainer.weight_bytes < 0 or trainer.micro_batch_tokens < 1:
            return "trainer: expected weight_bytes >= 0 and micro_batch_tokens >= 1"
        for i, length in enumerate(self.lengths):
            if length < 1:
                return f"lengths[{i}]: expected a positive number of tokens, got {length}"
        if self.prompt_tokens < 0:
            return f"prompt_tokens: expected 0 or more, got {self.prompt_tokens}"
        return None


PLANNING = (
    "planning profile, not measured on this hardware: expect errors of tens of percent (on a CPU, "
    "calibrated profiles reproduce their run within a few percent: docs/simulator.md)"
)
"""What `simulate` says of the built-in GPU profiles' confidence."""
