"""The one vocabulary every stage speaks: Prompt, Sample, Group, TrainBatch.

Records are frozen msgspec Structs; a stage that changes a record makes a new one with
`msgspec.structs.replace`. High-volume records skip the cycle collector (`gc=False`): they
hold only scalars and lists of scalars. This module holds data definitions and small derived
properties only, no behaviour of any stage.
"""

from __future__ import annotations

from typing import Any

import msgspec


class Message(msgspec.Struct, frozen=True, kw_only=True):
    """One chat message."""

    role: str
    content: str


class Prompt(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """A prompt as the engine sees it (token ids) plus what scoring needs (answer, task)."""

    id: str
    """Stable across runs and resumes: the ledger's key."""
    token_ids: list[int]
    messages: list[Message] = []
    answer: str | None = None
    """Reference answer for the task's verifier, if any."""
    task: str = ""
    metadata: dict[str, Any] = {}


class SamplingSpec(msgspec.Struct, frozen=True, kw_only=True):
    """What the engine sampled with; the trainer scores tokens under the same distribution."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    """0 = no top-k truncation."""
    max_tokens: int = 64
    ignore_eos: bool = False
    seed: int | None = None
    stop: tuple[str, ...] = ()
    """Stop sequences the engine ends the request at (the token that completes one is the last
    generated; its text is not cut): an agent's call's `stop`. They do not change the
    distribution the trainer scores under."""
    on_version: int | None = None
    """LoRA runs: the adapter version to generate with, when the engine still holds it (an
    episode's later turns ask for the one its first turn used); None, or one no longer held:
    the newest."""


class Segment(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """An earlier part of a sample recorded as a sequence of its own (an agent that rewrote its
    conversation's history): trained with the sample's advantage."""

    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    loss_mask: list[int]


class Sample(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """One completion of one prompt, with per-token provenance."""

    prompt_id: str
    group_id: str
    index: int
    """Position within the group, 0..G-1."""
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    logprobs: list[float]
    """Behaviour log-prob of each completion token under the distribution it was sampled from."""
    versions: list[int]
    """Engine version whose weights computed each completion token's logits."""
    loss_mask: list[int]
    """1 for tokens the policy produced, 0 for tool/environment tokens."""
    finish_reason: str
    sampling: SamplingSpec
    interruptions: int = 0
    """Times the sample was aborted and resubmitted (`resume`/`restart` modes)."""
    reward: float | None = None
    """Total reward; None until scored, or when unscorable."""
    unscorable: str | None = None
    """Why the sample could not be scored (it is then excluded from the group baseline)."""
    reward_parts: dict[str, float] = {}
    """Each reward function's value (the total is their weighted sum)."""
    teacher_logprobs: list[float] | None = None
    """On-policy distillation: each completion token's log-prob under the teacher."""
    process_rewards: list[tuple[int, float]] = []
    """Process (per-step) rewards: (index of the completion token that ends the step, reward).
    They count in `reward` too; `scoring.process_coef` also credits them to the tokens before them."""
    turns: int = 1
    """Model turns in the completion (more than one for a multi-turn episode)."""
    segments: list[Segment] = []
    """Earlier sequences of the same episode, split off when an agent rewrote its history; each
    shares this sample's reward and advantage (the last sequence is the sample itself)."""
    env_reward: str = "env"
    """The name an episode's own rewards are reported under (`reward_parts`, metrics): `env`, or
    a TRL environment class's name."""
    env_metrics: dict[str, float] = {}
    """What the environment measured of the episode besides its reward (a verifiers task's
    `@vf.metric`s and each `@vf.reward`'s own score), averaged per step into `env_metrics`."""
    budget: str | None = None
    """The episode budget that refused a call or cut a turn short: `turns` (`env.max_turns`), `tokens`
    (`env.max_tokens` or the context), `model_tokens` (`env.max_model_tokens`) or `time`
    (`env.time_budget_s`); None when none did. Counted per step in `budget_ends`."""
    done_version: int | None = None
    """The engine's version when the sample's generation ended (None: not recorded). It splits the
    sample's lag in two: in flight (this minus its oldest token's version: the policy moved while
    it generated) and in the queue (the consuming step minus this: it waited, finished, for the
    trainer). Counted per step in `lag_in_flight_hist` and `lag_in_queue_hist`."""
    made_by: str | None = None
    """The policy that made its tokens when not the run's (a recorded episode played back): its
    versions are those it was adopted under (`EpisodeContext.adopted`), its log-probs that
    policy's. Counted per step in `off_policy_samples`."""

    @property
    def num_tokens(self) -> int:
        return len(self.completion_token_ids)


class Group(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """The G samples of one prompt, with their advantages once computed."""

    prompt: Prompt
    samples: list[Sample]
    advantages: list[float] = []
    token_advantages: list[list[float] | None] = []
    """Per sample, per completion token advantage added to the sample's (process rewards); None
    for none. Empty when no sample of the group has process rewards."""


class TrainSample(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """One sample as the trainer consumes it: tokens, behaviour log-probs, mask, advantage."""

    input_ids: list[int]
    """Prompt + completion token ids."""
    prompt_len: int
    logprobs: list[float]
    """Behaviour log-prob per completion token."""
    loss_mask: list[int]
    """Per completion token: 1 in the loss, 0 for environment tokens or tokens withheld as too stale."""
    advantage: float
    token_advantages: list[float] | None = None
    """Per completion token advantages (process rewards, distillation); overrides `advantage`."""
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    old_logprobs: list[float] | None = None
    """The trainer's log-probs before this step's first update, the PPO ratio's reference (set by
    the trainer itself when it makes several updates per batch)."""

    @property
    def num_completion(self) -> int:
        return len(self.input_ids) - self.prompt_len


class TrainBatch(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """What one optimizer step consumes, as sent from the controller to every trainer rank."""

    step: int
    samples: list[TrainSample]
    max_tokens: int
    """The sampling budget per completion (the constant of `dr_grpo` normalisation)."""


Batch = TrainBatch
"""The public name of what one optimizer step consumes (`rollflow.Batch`)."""
