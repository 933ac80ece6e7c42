"""Named fault points, for crash tests of checkpoint and resume.

`point(name)` does nothing unless the environment variable `ROLLFLOW_FAULT` names it, as
`NAME` (the first time the point is reached) or `NAME:N` (the N-th time). Then the process
kills itself with SIGKILL on the spot: no cleanup, no `finally`, exactly as a machine failure or
the out-of-memory killer would. The points in the code are:

- `step-trained`: the optimizer step is done, its prompts not yet in the ledger;
- `weight-sync`: the engine is loading new weights;
- `checkpoint-write`: the checkpoint's tensors are written, its run state not yet;
- `checkpoint-saved`: a checkpoint has just been completed.

This module does not decide where points go; the code that owns each moment calls `point`.
"""

from __future__ import annotations

import os
import signal

_ENV = "ROLLFLOW_FAULT"
_seen: dict[str, int] = {}


def point(name: str) -> None:
    """Die here if `ROLLFLOW_FAULT` asks for this point (and this is the asked-for time)."""
    wanted = os.environ.get(_ENV)
    if not wanted:
        return
    target, _, nth = wanted.partition(":")
    if target != name:
        return
    _seen[name] = _seen.get(name, 0) + 1
    if _seen[name] == (int(nth) if nth else 1):
        os.kill(os.getpid(), signal.SIGKILL)
