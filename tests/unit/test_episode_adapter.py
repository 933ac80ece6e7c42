"""An episode under one adapter: the engine keeps the newest `max_loras - 1` adapter versions
(and any in use) so a later turn can ask for its first turn's, and every step counts the samples
that still mix versions. Real vLLM with LoRA: tests/integration/test_lora_sync.py."""

from __future__ import annotations

from rollflow.batch import mixes_versions
from rollflow.engine.adapters import Adapters
from rollflow.records import Sample, SamplingSpec, Segment


def sample(versions: list[int], mask: list[int], segments: list[Segment] | None = None) -> Sample:
    n = len(versions)
    return Sample(prompt_id="p", group_id="g", index=0, prompt_token_ids=[1], completion_token_ids=list(range(n)),
                  logprobs=[0.0] * n, versions=versions, loss_mask=mask, finish_reason="stop",
                  sampling=SamplingSpec(), segments=segments or [])  # fmt: skip


def test_a_sample_mixes_versions_only_in_the_models_own_tokens():
    assert not mixes_versions(sample([3, 3, 3], [1, 1, 1]))
    assert not mixes_versions(sample([3, 5, 3], [1, 0, 1]))  # the environment's token is not the model's
    assert mixes_versions(sample([3, 3, 4], [1, 1, 1]))
    earlier = Segment(prompt_token_ids=[1], completion_token_ids=[7], logprobs=[0.0], versions=[2], loss_mask=[1])
    assert mixes_versions(sample([3], [1], [earlier]))  # a history rewrite's earlier sequence counts too


def test_the_newest_versions_stay_loaded_and_older_ones_go_once_unused():
    adapters = Adapters()
    for version in range(1, 6):
        adapters.add(version, f"lora-{version}")
    adapters.use(1)  # a request still runs on version 1
    gone = adapters.unused(newest=5, keep=3)
    assert gone == ["lora-2"] and sorted(adapters.loaded) == [1, 3, 4, 5]
    adapters.release(1)
    assert adapters.unused(newest=5, keep=3) == ["lora-1"]
    assert adapters.unused(newest=6, keep=1) == ["lora-3", "lora-4", "lora-5"]
