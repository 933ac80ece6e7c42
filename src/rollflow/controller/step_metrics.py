"""The metrics of one optimizer step: one typed record, one line of `metrics.jsonl`.

`StepMetrics` names and documents every key the controller reports per step: what the batch
held (`rollflow.batch.build_batch`), what the trainer measured, and the step's timing and
throughput. Sinks, `RunResult.metrics` and `on_step` receive it as a plain dict (`as_row`).
The reference table in docs/metrics.md is checked against these fields by a test.
"""

from __future__ import annotations

from typing import Any

import msgspec


class StepMetrics(msgspec.Struct, kw_only=True):
    """One optimizer step, as reported."""

    step: int
    """The optimizer step (0-based, continuing across resumes)."""
    version: int
    """The policy version the step produced (step + 1)."""
    # ---- the batch
    reward_mean: float
    """Mean reward of the batch's scored samples."""
    reward_std: float
    """Standard deviation of those rewards."""
    rewards: dict[str, dict[str, float]]
    """Mean and std per reward function (by name)."""
    env_metrics: dict[str, float] = {}
    """Mean per metric an environment measured of its scored episodes (a verifiers task's `@vf.metric`s and
    `@vf.reward` scores)."""
    budget_ends: dict[str, int] = {}
    """Episodes of the batch's groups an episode budget ended, by budget (`turns`, `tokens`, `model_tokens`,
    `time`; `Sample.budget`), unscorable ones included."""
    samples: int
    """Samples in the batch (unscorable ones left out)."""
    tokens: int
    """Completion tokens of the batch."""
    turns_mean: float
    """Mean turns per sample (1 without an environment)."""
    lag_mean: float
    """Mean lag of every completion token of the batch (see the staleness definitions)."""
    lag_max: int
    """Largest token lag in the batch."""
    lag_hist: dict[str, int]
    """Lag -> number of tokens."""
    sample_lag_max: int
    """Largest sample lag (a sample's lag is its oldest token's)."""
    sample_lag_hist: dict[str, int]
    """Lag -> number of samples."""
    lag_in_flight_hist: dict[str, int] = {}
    """A sample's lag by cause, in flight: the versions the policy moved while it generated (the
    engine's version when it ended minus its oldest token's) -> number of samples. Large: generation
    is slow beside the updates (more engines, shorter completions; docs/tuning.md)."""
    lag_in_queue_hist: dict[str, int] = {}
    """A sample's lag by cause, in the queue: the steps it waited, finished, for the trainer (the
    consuming step minus the engine's version when it ended) -> number of samples. Large: samples
    wait for a slower trainer (a smaller `run.max_lag` keeps fewer in flight; docs/tuning.md)."""
    withheld_tokens: int
    """Tokens withheld from the loss because their lag exceeds `run.max_lag`."""
    withheld_by_reason: dict[str, int]
    """Withheld tokens by reason."""
    loss_lag_max: int
    """Largest lag of a token actually in the loss (never above `run.max_lag`)."""
    unscorable: int
    """Samples left out of the batch because they could not be scored."""
    unscorable_by_reason: dict[str, int]
    """Those samples by reason."""
    overlong_filtered: int = 0
    """Samples cut at the token budget left out of the loss (`rollout.overlong = "filter"`)."""
    agent_splits: int = 0
    """Extra sequences trained because an agent rewrote its conversation's history (`[env] kind = "agent"` or
    `"verifiers"`)."""
    off_policy_samples: int = 0
    """Samples of the batch's groups whose tokens another policy made (`Sample.made_by`: a recorded episode
    played back), unscorable ones included."""
    mixed_version_samples: int = 0
    """Samples of the batch's groups whose model tokens came from more than one policy version (an
    update landed while one generated: within a turn in `keep` mode, or between an episode's turns),
    unscorable ones included."""
    teacher_kl: float | None = None
    """On-policy distillation: mean of behaviour minus teacher log-prob over the batch's tokens."""
    teacher_gap_abs_max: float | None = None
    """On-policy distillation: largest absolute behaviour-teacher log-prob gap of a token."""
    # ---- the trainer
    loss: float = 0.0
    """The policy loss."""
    loss_tokens: float = 0.0
    """Tokens in the loss (mask 1, inside the sampling support)."""
    ratio_mean: float = 1.0
    """Mean importance ratio, trainer over behaviour probability, over the loss tokens."""
    ratio_min: float = 1.0
    """Smallest importance ratio."""
    ratio_max: float = 1.0
    """Largest importance ratio."""
    clip_frac: float = 0.0
    """Share of loss tokens whose ratio was clipped."""
    is_masked_frac: float = 0.0
    """Share of loss tokens masked by the importance-sampling correction (`loss.is_mode`)."""
    mismatch_kl: float = 0.0
    """KL estimate between behaviour and trainer log-probs (engine/trainer mismatch)."""
    entropy: float = 0.0
    """Mean entropy of the trainer's sampling distribution over the loss tokens."""
    kl_ref: float = 0.0
    """KL to the reference model (with `loss.kl_coef` > 0)."""
    outside_support_tokens: float = 0.0
    """Sampled tokens outside the trainer's top-k / top-p support, left out of the loss."""
    grad_norm: float = 0.0
    """Gradient norm before clipping."""
    lr: float = 0.0
    """Learning rate of the step."""
    skipped: float = 0.0
    """1 when a non-finite loss or gradient skipped the step (weights unchanged)."""
    # ---- time and throughput
    trainer_idle_frac: float
    """Share of the step interval spent waiting for a batch."""
    engine_idle_frac: float
    """Share of the step interval with no group generating."""
    gen_tokens_per_s: float
    """Tokens generated per second over the step interval."""
    trained_tokens_per_s: float
    """Completion tokens trained per second over the step interval."""
    samples_per_s: float
    """Samples trained per second over the step interval."""
    batch_wait_s: float
    """Time the training loop waited for the batch."""
    train_step_s: float
    """Time of the trainer step."""
    model_tokens: int = 0
    """Tokens the step put through the model in `trainer.layout`, padding included (each group's
    prompt once with `shared_prompt`): what a step's compute follows (the simulator's trainer
    cost is per model token)."""
    weight_sync_s: float
    """Time the training loop waited for weight sync: the previous engine load and the staging copy."""
    weight_sync_bytes: int
    """Bytes staged for the engine."""
    engine_update_s: float
    """The latest completed engine load, critical section included (with
    `engine.linear_layout = "staged"`, its stage too, while the engine generated)."""
    buffer_groups: int
    """Groups waiting in the buffer after the step."""
    engine_busy_s: float
    """Wall time with at least one group generating (cumulative)."""
    engine_restarts: int
    """Engines replaced after a death (cumulative)."""
    filtered_groups: int = 0
    """Groups dropped during the step's interval because every reward was equal (`rollout.filter_equal_rewards`)."""
    loop_lag_ms_mean: float
    """Mean event-loop lag since the last step (ms)."""
    loop_lag_ms_max: float
    """Largest event-loop lag since the last step (ms)."""
    wall_s: float
    """Seconds since the run started (continuing across resumes)."""
    # ---- evaluation during training (every `run.eval_every` steps)
    eval_accuracy: float | None = None
    """Greedy accuracy on the held-out prompts with this step's weights."""
    eval_pass_at_k: float | None = None
    """Share of held-out prompts with a correct one among `run.eval_pass_k` samples."""
    eval_s: float | None = None
    """Time the training loop waited for that evaluation."""
    eval_version: int | None = None
    """The policy version whose weights generated that evaluation's tokens."""

    def as_row(self) -> dict[str, Any]:
        """The plain dict sinks receive (absent values left out)."""
        return {k: v for k, v in msgspec.structs.asdict(self).items() if v is not None}


TRAINER_KEYS = frozenset(
    {
        "loss",
        "ratio_mean",
        "ratio_min",
        "ratio_max",
        "clip_frac",
        "is_masked_frac",
        "mismatch_kl",
        "entropy",
        "kl_ref",
        "outside_support_tokens",
        "grad_norm",
        "lr",
        "skipped",
    }
)
"""What a trainer step's metrics may hold besides `tokens` (reported as `loss_tokens`)."""
