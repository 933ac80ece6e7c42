"""The single asyncio controller: it owns every task and keeps the tokens flowing.

A package of small components; none of them references the controller, which builds them in
`Controller.setup` and drives them from `Controller.run`:

- `run`: `Controller` (wiring, the TaskGroup, teardown, `request_stop`), `train`;
- `result`: `RunResult`, what a run returns;
- `setup`: building tokenizer, sampler, trainer, teacher, engine and transport (`Components`);
- `producer`: admission -> prompt -> group of rollouts -> scoring -> advantages -> buffer, with
  one registry of the groups in flight;
- `training`: the training loop (groups -> batch -> step -> publish -> ledger, metrics, checkpoint);
- `step_metrics`: `StepMetrics`, every key of a step's metrics, documented;
- `weights`: publishing weights to the engine (full weights or LoRA adapters);
- `supervisor`: the engine in use, its health watch and restart, the one guarded-call helper;
- `trainer_thread`: where the trainer's calls run (one thread; several ranks through `ranks.Leader`);
- `persistence`: the output directory, resume checks, checkpoint writing and restoring;
- `accounting`: the ledger: every prompt trained or dropped with a reason, exactly once;
- `stall`: the stop rule for a run that cannot learn.

With several trainer ranks, rank 0 runs this controller and the others run `rollflow.ranks.follow`.
The controller computes no loss and moves no bytes itself.
"""

from rollflow.controller.result import RunResult
from rollflow.controller.run import Controller, train

__all__ = ["Controller", "RunResult", "train"]
