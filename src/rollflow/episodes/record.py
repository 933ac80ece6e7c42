"""An episode's recording, and the one function that makes a sample of it.

Every source records an episode the same way: token sequences (`Sequence`: the opening as the
chat template renders it, then each turn's tokens with their log-probs, versions and loss mask),
the sequences a history rewrite closed, and how the episode ended (`Recording`). `sample_of`
turns that into the `Sample` the rest of the run trains; `failed_episode` is the sample of an
episode that could not start. This module plays no episode and renders nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rollflow.records import Prompt, Sample, SamplingSpec, Segment


@dataclass(eq=False, kw_only=True)
class Sequence:
    """One token sequence of an episode: the opening, then the turns (model and environment)."""

    opening: list[int]
    """The opening's token ids (the prompt as the chat template renders it)."""
    rendered: str = ""
    """The text of the sequence so far, as the chat template would render it."""
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    finish_reason: str = "stop"
    """How its last model turn ended."""

    def add(self, tokens: list[int], logprobs: list[float], versions: list[int], mask: int) -> None:
        self.tokens += tokens
        self.logprobs += logprobs
        self.versions += versions
        self.mask += [mask] * len(tokens)

    def segment(self) -> Segment:
        return Segment(
            prompt_token_ids=list(self.opening),
            completion_token_ids=list(self.tokens),
            logprobs=list(self.logprobs),
            versions=list(self.versions),
            loss_mask=list(self.mask),
        )


@dataclass(eq=False, kw_only=True)
class Recording:
    """What an episode recorded, as `sample_of` reads it."""

    last: Sequence | None = None
    """The sequence the sample is (None: no turn was played; the sample is the prompt alone)."""
    closed: list[Sequence] = field(default_factory=list)
    """Earlier sequences a history rewrite closed, oldest first (the sample's segments)."""
    finish_reason: str | None = None
    """How the episode ended (None: as `last`'s last turn did)."""
    interruptions: int = 0
    """Weight updates its turns were interrupted by."""
    failure: str | None = None
    """Why it cannot be scored (`Sample.unscorable`)."""
    process_rewards: list[tuple[int, float]] = field(default_factory=list)
    turns: int = 1
    budget: str | None = None
    """The episode budget that refused a call or cut a turn short (`Sample.budget`)."""
    reward_name: str = "env"
    """What its own rewards are reported as (`Sample.env_reward`)."""
    done_version: int | None = None
    """The engine's version when it ended (`Sample.done_version`)."""


def sample_of(prompt: Prompt, recording: Recording, *, group_id: str, index: int, sampling: SamplingSpec) -> Sample:
    """Sample `index` of group `group_id`: `recording.last` as the completion after its opening
    (the prompt alone when no turn was played), the closed sequences as its segments. The sample
    holds copies: the recording may go on changing (an agent's call still in flight)."""
    last = recording.last
    finish = recording.finish_reason or (last.finish_reason if last is not None else "stop")
    return Sample(
        prompt_id=prompt.id,
        group_id=group_id,
        index=index,
        prompt_token_ids=list(last.opening) if last is not None else prompt.token_ids,
        completion_token_ids=list(last.tokens) if last is not None else [],
        logprobs=list(last.logprobs) if last is not None else [],
        versions=list(last.versions) if last is not None else [],
        loss_mask=list(last.mask) if last is not None else [],
        finish_reason=finish,
        sampling=sampling,
        interruptions=recording.interruptions,
        unscorable=recording.failure,
        process_rewards=recording.process_rewards,
        turns=max(recording.turns, 1),
        segments=[s.segment() for s in recording.closed],
        env_reward=recording.reward_name,
        budget=recording.budget,
        done_version=recording.done_version,
    )


def failed_episode(
    prompt: Prompt, sampling: SamplingSpec, *, group_id: str, index: int, reason: str, reward_name: str = "env"
) -> Sample:
    """The sample of an episode that could not start: the prompt alone, unscorable with `reason`."""
    recording = Recording(failure=reason, reward_name=reward_name)
    return sample_of(prompt, recording, group_id=group_id, index=index, sampling=sampling)
