"""The simulator: the real controller on virtual time, with simulated engines and trainer.

`simulate(scenario)` builds the same `Controller` that `rollflow.train` runs — the same
admission rule, buffer, staleness accounting, weight-sync pipelining, ledger and metrics —
and hands it a `SimEngine`, a `SimTrainer` and a `SimTransport` (`rollflow.sim.components`)
on a `VirtualTimeLoop` (`rollflow.sim.loop`): hours of training take seconds, and every
decision (which prompt starts when, which tokens are withheld) is the controller's own.

`python -m rollflow simulate` is the command line; `rollflow.sim.profiles` holds the default
timing per model size and GPU. This package does not train or generate anything.
"""

from __future__ import annotations

import asyncio
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from rollflow.config import load_config
from rollflow.controller import Controller
from rollflow.controller.setup import Given
from rollflow.plots import lag_histogram
from rollflow.sim.components import EngineProfile, SimEngine, SimTrainer, SimTransport, TrainerProfile
from rollflow.sim.lengths import LengthModel
from rollflow.sim.loop import run_virtual
from rollflow.testing import FakeTokenizer


@dataclass
class Scenario:
    """One configuration to simulate."""

    engine: EngineProfile
    trainer: TrainerProfile
    lengths: LengthModel = field(default_factory=LengthModel)
    inference_gpus: int = 1
    trainer_gpus: int = 1
    max_lag: int = 1
    partial: Literal["keep", "resume", "restart"] = "keep"
    steps: int = 50
    groups_per_step: int = 32
    group_size: int = 8
    prompt_tokens: int = 256
    max_tokens: int = 1024


@dataclass
class SimResult:
    scenario: Scenario
    steps: int
    wall_s: float
    """Virtual seconds from the first request to the end of the last step."""
    steady_s: float
    """Virtual seconds from the end of step 1 to the end of the last step."""
    steps_per_hour: float
    trainer_idle: float
    engine_idle: float
    """Share of replica time outside engine steps (steady state)."""
    lag_hist: dict[int, int]
    generated_tokens: int
    withheld_tokens: int
    preempted_tokens: int
    wasted_tokens: int
    """Withheld for staleness, plus tokens thrown away by `restart` preemptions."""
    metrics: list[dict[str, Any]]

    @property
    def lag_mean(self) -> float:
        total = sum(self.lag_hist.values())
        return sum(k * v for k, v in self.lag_hist.items()) / total if total else 0.0


async def _simulate(scenario: Scenario, output_dir: Path) -> SimResult:
    loop = asyncio.get_running_loop()
    overrides = [
        "model.path=sim",
        f"run.max_lag={scenario.max_lag}",
        f"run.max_steps={scenario.steps}",
        f"run.groups_per_step={scenario.groups_per_step}",
        f"rollout.group_size={scenario.group_size}",
        f"rollout.partial={scenario.partial}",
        f"sampling.max_tokens={scenario.max_tokens}",
        # The simulated engine's context holds the scenario's prompts and completions.
        f"engine.max_model_len={scenario.prompt_tokens + scenario.max_tokens}",
        "run.reward=digits",
        "observe.sinks=[]",
        "checkpoint.enabled=false",  # a simulated trainer has no state to save
    ]
    config = load_config(preset="tiny", overrides=overrides)
    engine = SimEngine(scenario.engine, scenario.lengths, replicas=scenario.inference_gpus)
    trainer = SimTrainer(scenario.trainer, scenario.trainer_gpus)
    engine.trainer, trainer.engine = trainer, engine  # for the `contended` factors of a shared host
    busy_at: list[float] = []
    controller = Controller(
        config,
        output_dir,
        on_step=lambda _row: busy_at.append(engine.busy_s),
        given=Given(
            engine=engine,
            runner=trainer,
            transport=SimTransport(scenario.trainer),
            tokenizer=FakeTokenizer(prompt_tokens=scenario.prompt_tokens),
            clock=loop.time,
        ),
    )
    result = await controller.run()
    metrics = result.metrics
    first, last = metrics[0], metrics[-1]
    steady_s = last["wall_s"] - first["wall_s"] if len(metrics) > 1 else last["wall_s"]
    steady = metrics[1:] or metrics
    replica_s = steady_s * scenario.inference_gpus
    busy = busy_at[-1] - busy_at[0] if len(busy_at) > 1 else busy_at[-1]
    withheld = sum(m["withheld_tokens"] for m in metrics)
    preempted = engine.preempted_tokens if scenario.partial == "restart" else 0
    return SimResult(
        scenario=scenario,
        steps=result.steps,
        wall_s=last["wall_s"],
        steady_s=steady_s,
        steps_per_hour=3600 * (len(steady) / steady_s) if steady_s > 0 else 0.0,
        trainer_idle=sum(m["batch_wait_s"] + m["weight_sync_s"] for m in steady) / steady_s if steady_s else 0.0,
        engine_idle=max(0.0, 1 - busy / replica_s) if replica_s > 0 else 0.0,
        lag_hist=lag_histogram(metrics),
        generated_tokens=engine.tokens_generated,
        withheld_tokens=withheld,
        preempted_tokens=engine.preempted_tokens,
        wasted_tokens=withheld + preempted,
        metrics=metrics,
    )


def simulate(scenario: Scenario, output_dir: str | Path | None = None) -> SimResult:
    """Run one scenario on virtual time. With `output_dir`, the run's files (metrics, ledger,
    trace.json) stay there, so `rollflow report` / `plot` work on a simulated run too."""
    if output_dir is not None:
        return run_virtual(_simulate(scenario, Path(output_dir)))
    with tempfile.TemporaryDirectory(prefix="rollflow-sim-") as scratch:
        return run_virtual(_simulate(scenario, Path(scratch)))


SWEEPABLE = {
    "inference-gpus": ("inference_gpus", int),
    "trainer-gpus": ("trainer_gpus", int),
    "max-lag": ("max_lag", int),
    "groups": ("groups_per_step", int),
    "group-size": ("group_size", int),
    "max-tokens": ("max_tokens", int),
}


def sweep(scenario: Scenario, name: str, values: list[Any]) -> list[SimResult]:
    """Simulate `scenario` once per value of one parameter (a key of `SWEEPABLE`)."""
    return [simulate(varied(scenario, name, v)) for v in values]


def varied(scenario: Scenario, name: str, value: Any) -> Scenario:
    """`scenario` with one `SWEEPABLE` parameter changed."""
    attribute, kind = SWEEPABLE[name]
    changes: dict[str, Any] = {attribute: kind(value)}
    return replace(scenario, **changes)


__all__ = ["EngineProfile", "LengthModel", "Scenario", "SimResult", "TrainerProfile", "simulate", "sweep", "varied"]
