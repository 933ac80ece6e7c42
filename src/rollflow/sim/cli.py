"""`python -m rollflow simulate`: one scenario, or a sweep of one parameter as a table and a chart."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from rollflow.errors import UserInputError
from rollflow.sim import SWEEPABLE, Scenario, SimResult, simulate, varied
from rollflow.sim.calibrate import PLANNING, Calibration
from rollflow.sim.components import TrainerProfile
from rollflow.sim.lengths import LengthModel
from rollflow.sim.profiles import engine_profile, trainer_profile

HEADER = (
    f"{'':>16}{'steps/hour':>12}{'trainer idle':>14}{'engine idle':>13}{'lag mean':>10}  {'token lags':<28}"
    f"{'wasted':>9}"
)


def _positive(name: str, value: int) -> int:
    if value <= 0:
        raise UserInputError(f"--{name}: expected a positive number, got {value}")
    return value


DEFAULT_LENGTHS = "lognormal:300,0.8"


def calibration_of(args: argparse.Namespace) -> Calibration | None:
    """The `--profile` calibration, or None for the built-in planning profiles."""
    if getattr(args, "profile", None) is None:
        return None
    try:
        return Calibration.load(args.profile)
    except ValueError as err:
        raise UserInputError(str(err)) from None


def scenario_from(args: argparse.Namespace, calibration: Calibration | None = None) -> Scenario:
    for name in ("inference_gpus", "trainer_gpus", "steps", "groups", "group_size", "prompt_tokens", "max_tokens"):
        _positive(name.replace("_", "-"), getattr(args, name))
    if args.max_lag < 0:
        raise UserInputError(f"--max-lag: expected 0 or more, got {args.max_lag}")
    try:
        if args.lengths is None and calibration is not None and calibration.lengths:
            lengths = LengthModel(empirical=calibration.lengths, rho=args.rho)
        else:
            lengths = LengthModel.parse(args.lengths or DEFAULT_LENGTHS, rho=args.rho)
    except ValueError as err:
        raise UserInputError(str(err)) from None
    if calibration is not None:
        engine, trainer = calibration.engine, calibration.trainer
    else:
        engine, trainer = engine_profile(args.model_size, args.gpu), trainer_profile(args.model_size)
    trainer = with_link(trainer, getattr(args, "sync_gb_per_s", None), getattr(args, "delta_fraction", None))
    return Scenario(
        engine=engine,
        trainer=trainer,
        lengths=lengths,
        inference_gpus=args.inference_gpus,
        trainer_gpus=args.trainer_gpus,
        max_lag=args.max_lag,
        partial=args.partial,
        steps=args.steps,
        groups_per_step=args.groups,
        group_size=args.group_size,
        prompt_tokens=args.prompt_tokens,
        max_tokens=args.max_tokens,
    )


def with_link(trainer: TrainerProfile, gb_per_s: float | None, delta_fraction: float | None) -> TrainerProfile:
    """`trainer` with the weight sync's bandwidth (`--sync-gb-per-s`) and the share of bytes an
    update moves after the first (`--delta-fraction`: the changed elements, from a staged copy)."""
    if gb_per_s is not None:
        if not gb_per_s > 0:
            raise UserInputError(f"--sync-gb-per-s: expected a positive bandwidth in GB/s, got {gb_per_s}")
        trainer = replace(trainer, sync_bytes_per_s=gb_per_s * 1e9)
    if delta_fraction is not None:
        if not 0 < delta_fraction <= 1:
            raise UserInputError(f"--delta-fraction: expected a share of the bytes in (0, 1], got {delta_fraction}")
        trainer = replace(trainer, delta_fraction=delta_fraction, snapshots=True)
    return trainer


def row(label: str, r: SimResult) -> str:
    total = sum(r.lag_hist.values()) or 1
    lags = " ".join(f"{k}:{v / total:.0%}" for k, v in r.lag_hist.items())
    return (
        f"{label:>16}{r.steps_per_hour:>12.1f}{r.trainer_idle:>14.1%}{r.engine_idle:>13.1%}{r.lag_mean:>10.2f}"
        f"  {lags:<28}{r.wasted_tokens / max(r.generated_tokens, 1):>9.1%}"
    )


def parse_sweep(spec: str) -> tuple[str, list[int]]:
    name, _, values = spec.partition("=")
    if name not in SWEEPABLE or not values:
        raise UserInputError(f"--sweep {spec!r}: expected NAME=V1,V2,... with NAME one of {', '.join(SWEEPABLE)}")
    try:
        parsed = [int(v) for v in values.split(",")]
    except ValueError:
        raise UserInputError(f"--sweep {spec!r}: values must be whole numbers") from None
    if min(parsed) < (0 if name == "max-lag" else 1):
        raise UserInputError(f"--sweep {spec!r}: values out of range")
    return name, parsed


def run_simulate(args: argparse.Namespace) -> int:
    calibration = calibration_of(args)
    scenario = scenario_from(args, calibration)
    s = scenario
    hardware = f"profile {args.profile}" if calibration is not None else f"model {args.model_size} on {args.gpu}"
    lengths = args.lengths or ("the profile's" if calibration is not None and calibration.lengths else DEFAULT_LENGTHS)
    print(
        f"{hardware}; {s.inference_gpus} inference GPU(s), {s.trainer_gpus} trainer GPU(s);"
        f" {s.groups_per_step} groups x {s.group_size} samples, prompt {s.prompt_tokens} tokens, lengths"
        f" {lengths} (max {s.max_tokens}), max_lag {s.max_lag}, partial {s.partial}, {s.steps} steps"
    )
    link = f"weight sync {s.trainer.sync_bytes_per_s / 1e9:.3g} GB/s"
    if s.trainer.delta_fraction < 1:
        link += f", after the first update {s.trainer.delta_fraction:.3g} of the bytes (changed elements only)"
    print(link)
    print(f"confidence: {calibration.confidence() if calibration is not None else PLANNING}")
    print("(virtual time; wasted = tokens generated then withheld for staleness or discarded by restart)")
    print(HEADER)
    if not args.sweep:
        if args.plot:
            raise UserInputError("--plot needs --sweep")
        result = simulate(scenario, args.output_dir)
        print(row("result", result), flush=True)
        return 0
    name, values = parse_sweep(args.sweep)
    results = []
    for value in values:
        result = simulate(varied(scenario, name, value))
        results.append(result)
        print(row(f"{name}={value}", result), flush=True)
    if args.plot:
        plot_sweep(name, values, results, args.plot)
        print(args.plot, file=sys.stderr)
    return 0


def plot_sweep(name: str, values: list[int], results: list[SimResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, left = plt.subplots(figsize=(7, 4))
    left.plot(values, [r.steps_per_hour for r in results], marker="o", color="#4c72b0", label="steps/hour")
    left.set_xlabel(name)
    left.set_ylabel("steps / hour")
    right = left.twinx()
    right.plot(values, [r.trainer_idle for r in results], marker="s", color="#dd8452", label="trainer idle")
    right.plot(values, [r.engine_idle for r in results], marker="^", color="#55a868", label="engine idle")
    right.set_ylabel("idle fraction")
    right.set_ylim(0, 1)
    lines = left.get_lines() + right.get_lines()
    left.legend(lines, [str(line.get_label()) for line in lines], loc="center right")
    left.set_title(f"simulated: {name} sweep", fontsize=10, loc="left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
