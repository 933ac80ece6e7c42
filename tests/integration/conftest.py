"""Shared real components: vLLM engines per session on the tiny model (one of them lent to every
training run of the tiny preset in turn), and HF references."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
import torch

from rollflow.config import EngineConfig
from rollflow.engine.vllm import VLLMEngine
from rollflow.models import tiny_model_path
from rollflow.records import Prompt, SamplingSpec
from rollflow.rollout import Progress, rollout


@pytest.fixture
def torchrun():
    """The command line that starts two local ranks; `--standalone` lets the rendezvous bind its
    own port, so no port is chosen in advance and none can be taken in between."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


class HFReference:
    """Greedy decoding and log-softmax with plain transformers, float32: the ground truth."""

    def __init__(self, path: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.path = path
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    @torch.no_grad()
    def greedy(self, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
        """n greedy tokens after `prompt` and each one's log-prob (EOS not special)."""
        ids = list(prompt)
        tokens, logprobs = [], []
        for _ in range(n):
            logits = self.model(torch.tensor([ids])).logits[0, -1]
            logp = torch.log_softmax(logits.double(), dim=-1)
            token = int(torch.argmax(logits))
            tokens.append(token)
            logprobs.append(float(logp[token]))
            ids.append(token)
        return tokens, logprobs

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict()


@pytest.fixture(scope="session")
def model_a() -> HFReference:
    return HFReference(tiny_model_path(0))


@pytest.fixture(scope="session")
def model_b() -> HFReference:
    return HFReference(tiny_model_path(1))


@pytest.fixture(scope="session")
async def session_engines():
    """The session's shared engines, closed together at its end (each takes 3-5 s to shut down)."""
    engines: list[VLLMEngine] = []
    yield engines
    await asyncio.gather(*(eng.aclose() for eng in engines))


@pytest.fixture(scope="session")
async def engine(session_engines):
    """An engine in the default linear layout (`staged`)."""
    eng = VLLMEngine(
        tiny_model_path(0),
        EngineConfig(kv_cache_bytes=128 * 1024 * 1024, max_model_len=512, max_num_seqs=16),
    )
    session_engines.append(eng)
    return await eng.start()


@pytest.fixture(scope="session")
async def plain_engine(session_engines):
    """An engine whose linear layers keep torch's weights (`engine.linear_layout = "plain"`)."""
    eng = VLLMEngine(
        tiny_model_path(0),
        EngineConfig(kv_cache_bytes=64 * 1024 * 1024, max_model_len=512, max_num_seqs=8, linear_layout="plain"),
    )
    session_engines.append(eng)
    return await eng.start()


@pytest.fixture(scope="session")
async def tiny_preset_engine(session_engines):
    """`await tiny_preset_engine()`: an engine of the tiny preset's settings for one training run
    (`Controller(config, out, engine=...)`), back on the initial weights at version 0 (a run's
    `start` and `aclose` leave it running). One per test session: the runs that would each start
    their own engine for the same settings share it."""
    from transformers import AutoModelForCausalLM

    from rollflow.config import load_config
    from rollflow.testing import lend

    eng = VLLMEngine(tiny_model_path(0), load_config(preset="tiny").engine)
    session_engines.append(eng)
    await eng.start()
    weights = AutoModelForCausalLM.from_pretrained(tiny_model_path(0)).state_dict()

    async def lent():
        return await lend(eng, weights)

    return lent


@pytest.fixture
async def engine_on_a(engine, model_a):
    """The engine, guaranteed to hold model A's weights afterwards (tests may load others)."""
    yield engine
    await engine.update_weights(model_a.state_dict())


async def _streaming(
    engine, token_ids: list[int], group_id: str, max_tokens: int, partial: str = "keep", after_tokens: int = 4
) -> asyncio.Task:
    """A greedy rollout of `token_ids` (request `group_id/0`), started and seen to have made
    `after_tokens` tokens. Tokens, not time: a fast machine streams a whole rollout in the time a
    slow one takes for a few, so an update sent now lands mid-stream on either."""
    spec = SamplingSpec(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    progress = Progress()
    prompt = Prompt(id="live", token_ids=token_ids)
    task = asyncio.create_task(
        rollout(engine, prompt, spec, group_id=group_id, index=0, partial=partial, progress=progress)
    )
    while len(progress.snapshot(engine).tokens) < after_tokens:
        assert not task.done(), "the stream finished before the update; make it longer"
        await asyncio.sleep(0.002)
    return task


@pytest.fixture
def streaming():
    """`_streaming`: start a rollout an update is to interrupt."""
    return _streaming


@pytest.fixture(scope="session")
def stop_inside():
    """`stop_inside(tokens)`: a stop sequence that first appears in the text of the tiny model's
    `tokens` past their middle, and how many of them it takes for the text to hold it (where an
    engine that honours it ends the request). The random model writes stray bytes; a sequence
    whose last token leaves a character incomplete is passed over (vLLM holds such text back
    until the character is whole, so it would stop a token later)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path(0))

    def find(tokens: list[int]) -> tuple[str, int]:
        def text(n: int) -> str:
            return tokenizer.decode(tokens[:n], skip_special_tokens=True)

        whole = text(len(tokens))
        for at in range(len(text(len(tokens) // 2)), len(whole) - 3):
            stop = whole[at : at + 3]
            if "\ufffd" in stop or whole.find(stop) != at:
                continue
            n = next(n for n in range(1, len(tokens) + 1) if stop in text(n))
            if not text(n).endswith("\ufffd") and n < len(tokens):
                return stop, n
        raise AssertionError(f"no stop sequence to test with in {whole!r}")

    return find
