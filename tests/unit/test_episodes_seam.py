"""The episode seam on its own: a source that plays back recorded episodes is one class, learns
the policy version through its context and trains its tokens instead of losing them as stale."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

import rollflow.controller.setup as setup
from rollflow.batch import build_batch
from rollflow.config import ToolEnvConfig, load_config
from rollflow.controller import Controller
from rollflow.controller.setup import Given
from rollflow.episodes import EpisodeContext, EpisodeSource, Recording, Sequence, sample_of
from rollflow.errors import UserInputError
from rollflow.records import Group, Prompt, Sample, SamplingSpec
from rollflow.testing import FakeEngine, FakeTokenizer, FakeTrainer, NullTransport

SPEC = SamplingSpec(max_tokens=8)


def recorded(prompt: Prompt, group_id: str, index: int) -> Sample:
    """An episode recorded under policy version 0: an earlier sequence, then the last one, with
    its reward at its last token (one more per index, so a group's rewards differ)."""
    earlier = Sequence(opening=[1, 2], tokens=[7, 8], logprobs=[-0.3, -0.4], versions=[0, 0], mask=[1, 1])
    last = Sequence(opening=[1, 2, 7, 8, 9], tokens=[5, 6, 4], logprobs=[-1.0, -2.0, 0.0], versions=[0, 0, 0])
    last.mask = [1, 1, 0]
    recording = Recording(last=last, closed=[earlier], process_rewards=[(2, float(index))], turns=2)
    return sample_of(prompt, recording, group_id=group_id, index=index, sampling=SPEC)


class Tokenizer(FakeTokenizer):
    """The fake tokenizer with what a chat format reads of it."""

    eos_token = "</s>"

    def __call__(self, text: str) -> dict[str, list[int]]:
        """Raw prompts (`data.template = "raw"`): one token per character."""
        return {"input_ids": [ord(c) % 997 + 1 for c in text]}


class ReplaySource(EpisodeSource):
    """Plays back recorded episodes (here made up; from a file in practice), adopted as the
    current policy's so staleness does not drop them."""

    renders_chat = False

    def __init__(self) -> None:
        self.settings = ToolEnvConfig()
        self.versions_seen: list[int] = []

    async def play(self, prompt, *, group_id, index, generate, context):
        self.versions_seen.append(context.version())
        return context.adopted(recorded(prompt, group_id, index), "recorded")


def test_an_adopted_sample_carries_the_current_version_and_keeps_its_log_probs(chat):
    context = EpisodeContext(chat=chat, sampling=SPEC, max_model_len=64, version=lambda: 7)
    prompt = Prompt(id="p", token_ids=[1, 2])
    sample = recorded(prompt, "g0", 1)
    adopted = context.adopted(sample, "recorded")
    assert adopted.versions == [7, 7, 7]
    assert [s.versions for s in adopted.segments] == [[7, 7]]
    assert adopted.logprobs == sample.logprobs and adopted.segments[0].logprobs == [-0.3, -0.4]
    assert adopted.made_by == "recorded" and sample.made_by is None
    assert adopted.completion_token_ids == sample.completion_token_ids
    assert adopted.process_rewards == [(2, 1.0)] and adopted.loss_mask == [1, 1, 0]


def test_a_recorded_episode_is_withheld_as_stale_unless_adopted(chat):
    context = EpisodeContext(chat=chat, sampling=SPEC, max_model_len=64, version=lambda: 10)
    prompt = Prompt(id="p", token_ids=[1, 2])
    plain = [scored(recorded(prompt, "g0", i)) for i in range(2)]
    adopted = [scored(context.adopted(recorded(prompt, "g0", i), "recorded")) for i in range(2)]
    # Each sample trains as two sequences with 2 model tokens each: 4 per sample, lag 10 > 1 when not adopted.
    for samples, withheld, off_policy in ((plain, 8, 0), (adopted, 0, 2)):
        group = Group(prompt=prompt, samples=samples, advantages=[-1.0, 1.0])
        batch, stats = build_batch(10, [group], max_lag=1, max_tokens=64, reward_name="env")
        assert stats["withheld_tokens"] == withheld
        assert stats["off_policy_samples"] == off_policy
        assert sum(sum(s.loss_mask) for s in batch.samples) == 8 - withheld
        assert stats["samples"] == 4


def scored(sample: Sample) -> Sample:
    return msgspec.structs.replace(sample, reward=sum(r for _, r in sample.process_rewards))


async def test_a_replay_source_learns_the_engine_version_and_none_of_its_tokens_is_withheld(tmp_path, monkeypatch):
    source = ReplaySource()
    monkeypatch.setattr(setup, "episode_source", lambda config, **given: source)
    config = load_config(
        preset="tiny",
        overrides=["run.max_steps=4", "run.max_lag=0", "rollout.group_size=2"],
    )
    engine = FakeEngine()
    controller = Controller(
        config,
        tmp_path,
        given=Given(engine=engine, trainer=FakeTrainer(), transport=NullTransport(), tokenizer=Tokenizer()),
    )
    result = await asyncio.wait_for(controller.run(), 60)
    steps = result.metrics
    assert len(steps) == 4
    assert all(m["withheld_tokens"] == 0 for m in steps), [m["withheld_tokens"] for m in steps]
    assert all(m["off_policy_samples"] == m["samples"] // 2 for m in steps)  # two sequences each
    assert all(m["samples"] > 0 for m in steps)
    # Synchronous: every group of step n is played under version n, and the source saw it.
    assert sorted(set(source.versions_seen)) == [0, 1, 2, 3]
    assert engine.version == 4


@pytest.mark.parametrize("renders", [True, False])
async def test_a_model_without_a_chat_template_is_refused_only_for_a_source_that_renders_chat(
    tmp_path, monkeypatch, renders
):
    source = ReplaySource()
    source.renders_chat = renders
    monkeypatch.setattr(setup, "episode_source", lambda config, **given: source)
    tokenizer = Tokenizer()
    tokenizer.chat_template = None  # type: ignore[assignment]
    overrides = ["run.max_steps=1", "rollout.group_size=2", "data.template=raw"]
    config = load_config(preset="tiny", overrides=overrides)
    given = Given(engine=FakeEngine(), trainer=FakeTrainer(), transport=NullTransport(), tokenizer=tokenizer)
    run = Controller(config, tmp_path, given=given).run()
    if renders:
        with pytest.raises(UserInputError, match="no chat template.*environments render conversations"):
            await asyncio.wait_for(run, 60)
    else:
        result = await asyncio.wait_for(run, 60)
        assert len(result.metrics) == 1
