"""Named fault points, for crash tests of checkpoint and resume.

`point(name)` does nothing unless the environment variable `ROLLFLOW_FAULT` names it, as
`NAME` (the first time the point is reached) or `NAME:N` (the N-th time). Then the process
kills itself with SIGKILL on the spot: no cleanup, no `finally`, exactly as a machine failure or
the out-of-memory killer would. `NAME:N:raise` raises `InjectedFault` there instead (an
ordinary error, which the code around the point handles as it would any other). The points in
the code are:

- `step-trained`: the optimizer step is done, its prompts not yet in the ledger;
- `weight-sync`: the engine is loading new weights;
- `weights-loaded`: inside the engine process, a one-call weight update has loaded the new
  weights and not yet labelled them (`rollflow.engine.worker.rollflow_update`);
- `stage`: inside the engine process, a staged load (`engine.linear_layout = "staged"`) has
  written the plain linear weights and not yet packed them (on the stage thread);
- `checkpoint-write`: the checkpoint's tensors are written, its run state not yet;
- `checkpoint-saved`: a checkpoint has just been completed;
- `leader-step`: with several trainer ranks, rank 0 has announced a step, the others are in it;
- `load-copy` (asked of `skipped`, as `NAME:N:skip`): inside the engine process, a repeated load
  copied into the model in place (or staged) silently leaves its first tensor out, as a buggy
  loader or transport would.

This module does not decide where points go; the code that owns each moment calls `point`.
"""

from __future__ import annotations

import os
import signal

_ENV = "ROLLFLOW_FAULT"
_seen: dict[str, int] = {}


class InjectedFault(RuntimeError):
    """The error a `NAME:N:raise` fault raises."""


def point(name: str) -> None:
    """Die (or raise) here if `ROLLFLOW_FAULT` asks for this point at this time."""
    wanted = os.environ.get(_ENV)
    if not wanted:
        return
    target, _, rest = wanted.partition(":")
    if target != name:
        return
    nth, _, how = rest.partition(":")
    if how == "skip":  # asked of `skipped`, not here
        return
    _seen[name] = _seen.get(name, 0) + 1
    if _seen[name] != (int(nth) if nth else 1):
        return
    if how == "raise":
        raise InjectedFault(f"injected fault at {name} (time {_seen[name]})")
    os.kill(os.getpid(), signal.SIGKILL)


def skipped(name: str) -> bool:
    """Whether `ROLLFLOW_FAULT` asks the code here to leave its work undone, silently, this time
    (`NAME:N:skip`: the N-th time `skipped(NAME)` is asked; `NAME::skip`: the first)."""
    target, _, rest = os.environ.get(_ENV, "").partition(":")
    nth, _, how = rest.partition(":")
    if target != name or how != "skip":
        return False
    _seen[name] = _seen.get(name, 0) + 1
    return _seen[name] == (int(nth) if nth else 1)
