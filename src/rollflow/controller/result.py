"""What a training run returns."""

from __future__ import annotations

from typing import Any

import msgspec

from rollflow.evaluate import EvalReport


class RunResult(msgspec.Struct):
    """What `train` returns: per-step metrics, prompt accounting and held-out evaluation."""

    steps: int
    wall_s: float
    metrics: list[dict[str, Any]]
    trained_prompts: int
    dropped: dict[str, int]
    eval_before: EvalReport | None = None
    """Greedy accuracy on the held-out prompts before the first step (`run.eval_prompts`)."""
    eval_after: EvalReport | None = None
    """The same after the last step."""
    pass_before: EvalReport | None = None
    """With `run.eval_pass_k`: k sampled completions per held-out prompt before the first step
    (`pass_at_group` is pass@k)."""
    pass_after: EvalReport | None = None
    """The same after the last step."""
    engine_busy_s: float = 0.0
    """Wall time with at least one group generating."""
    first_step: int = 0
    """The step this run started at (> 0 when resumed from a checkpoint)."""
    stopped: bool = False
    """Stopped early by `request_stop`; the checkpoint holds the work in progress."""
    checkpoint: str | None = None
    """The last checkpoint written."""
    final_model: str | None = None
    """The trained policy as a Hugging Face folder (`final/`; `checkpoint.final_model`)."""
