"""Helpers every test may use, as fixtures: fake-controller runs, tiny configs, trainer batches,
and checks of the fake engine's per-token versions."""

from __future__ import annotations

import asyncio
import json
import random

import msgspec
import pytest
import torch

from rollflow.config import load_config
from rollflow.controller import Controller
from rollflow.controller.setup import Given
from rollflow.records import TrainBatch, TrainSample
from rollflow.testing import EOS_TOKEN, FakeTokenizer, FakeTrainer, NullTransport, context_state, fake_token, mix


def _tiny_config(max_tokens: int = 12, **run):
    """The tiny preset with the `digits` reward, `sampling.max_tokens` and `run.*` overrides."""
    overrides = [f"run.{k}={v}" for k, v in run.items()]
    return load_config(preset="tiny", overrides=["run.reward=digits", f"sampling.max_tokens={max_tokens}", *overrides])


@pytest.fixture
def tiny_config():
    return _tiny_config


@pytest.fixture
def run_fake():
    """`await run_fake(tmp_path, engine, trainer=None, max_tokens=12, **run)`: a whole controller
    run on fakes; returns (result, trainer, ledger lines, controller)."""

    async def run(tmp_path, engine, trainer=None, max_tokens=12, **run):
        trainer = trainer or FakeTrainer()
        controller = Controller(
            _tiny_config(max_tokens, **run),
            tmp_path,
            given=Given(engine=engine, trainer=trainer, transport=NullTransport(), tokenizer=FakeTokenizer()),
        )
        result = await asyncio.wait_for(controller.run(), 60)
        ledger = [json.loads(line) for line in (tmp_path / "ledger.jsonl").read_text().splitlines()]
        return result, trainer, ledger, controller

    return run


@pytest.fixture
def record_groups(monkeypatch):
    """Every group the controller puts into a batch, in order (a list filled as the run goes)."""
    import rollflow.controller.training as training

    seen: list = []
    build = training.build_batch

    def recording(step, groups, **kwargs):
        seen.extend(groups)
        return build(step, groups, **kwargs)

    monkeypatch.setattr(training, "build_batch", recording)
    return seen


def _versions_exact(prompt_ids, tokens, versions):
    """FakeEngine's token after a context is a hash of (context, version): replaying the
    sample shows every token was computed by exactly the version it is labelled with."""
    state = context_state(prompt_ids)
    for token, version in zip(tokens, versions, strict=True):
        if token != EOS_TOKEN:
            assert token == fake_token(state, version, 1000)[0]
        state = mix(state, token)


@pytest.fixture
def assert_versions_exact():
    return _versions_exact


def _make_batch(trainer, n: int = 6, seed: int = 0, group: int = 1, **sampling) -> TrainBatch:
    """Completions sampled from the model itself, with its own log-probs as behaviour (on-policy);
    `group` consecutive samples share a prompt."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    samples = []
    for i in range(n):
        if i % group == 0:
            prompt = [rng.randrange(3, 800) for _ in range(rng.randint(3, 9))]
        with torch.no_grad():
            out = trainer.lm.generate(
                torch.tensor([prompt], device=trainer.device), do_sample=True, max_new_tokens=rng.randint(2, 12),
                min_new_tokens=2,
                temperature=sampling.get("temperature", 1.0), top_k=sampling.get("top_k", 0) or None,
                top_p=sampling.get("top_p", 1.0), pad_token_id=0,
            )
        completion = out[0, len(prompt):].tolist()
        samples.append(TrainSample(
            input_ids=prompt + completion, prompt_len=len(prompt), logprobs=[0.0] * len(completion),
            loss_mask=[1] * len(completion), advantage=(1.0 if i % 2 else -1.0) * (0.5 + i / n), **sampling,
        ))
    behaviour = trainer.score(samples)
    samples = [msgspec.structs.replace(s, logprobs=lp) for s, lp in zip(samples, behaviour, strict=True)]
    return TrainBatch(step=0, samples=samples, max_tokens=12)


@pytest.fixture
def make_batch():
    """`make_batch(trainer, n=6, seed=0, group=1, **sampling)`: an on-policy batch from the model itself."""
    return _make_batch


def assert_close(got: torch.Tensor, want: torch.Tensor, rel: float, name: str = "") -> None:
    """Equal up to `rel` times the reference's largest magnitude: a tolerance that holds for any
    summation order (a sum over many elements can differ by a few ulps of its scale anywhere)."""
    scale = want.abs().max().item() if want.numel() else 0.0
    diff = (got - want).abs().max().item() if want.numel() else 0.0
    assert diff <= rel * max(scale, 1e-12), f"{name}: max |got - want| = {diff:.3g} > {rel:g} x scale {scale:.3g}"


@pytest.fixture
def close():
    """`close(got, want, rel, name)`: see `assert_close`."""
    return assert_close


@pytest.fixture(scope="session")
def chat():
    """The tiny model's chat format (its real tokenizer and template), for episode tests."""
    from rollflow.envs import ChatFormat
    from rollflow.models import load_tokenizer, tiny_model_path

    return ChatFormat(load_tokenizer(tiny_model_path(0)))


@pytest.fixture
async def agent_server():
    """A started agents' endpoint (`rollflow.agent.AgentServer`) serving model `tiny` with
    temperature 1 and 64 tokens per call; closed after the test."""
    from rollflow.agent import AgentServer
    from rollflow.records import SamplingSpec

    server = AgentServer("tiny", SamplingSpec(temperature=1.0, max_tokens=64))
    await server.start()
    yield server
    await server.aclose()


@pytest.fixture
def example_environments(monkeypatch, request):
    """examples/environments/ on sys.path (the example verifiers and OpenEnv environments, which
    are loaded by module name); returns the folder."""
    folder = request.config.rootpath / "examples" / "environments"
    monkeypatch.syspath_prepend(str(folder))
    return folder


LONGEST_FIRST = (
    "integration/test_resume.py",
    "integration/test_cli.py",
    "integration/test_remote_engine.py",
    "integration/test_update_failure.py",
    "integration/test_train.py",
    "integration/test_export.py",
    "integration/test_weight_sync.py",
    "integration/test_trainer_ranks.py",
    "integration/test_lora_sync.py",
    "unit/test_trainer.py",
    "unit/test_gpu_check.py",
)
"""The test files that take longest, longest first: with one file per worker at a time
(`--dist loadfile`), starting them first keeps both workers busy to the end."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        path = item.path.as_posix()
        for i, name in enumerate(LONGEST_FIRST):
            if path.endswith(name):
                return i
        return len(LONGEST_FIRST) + ("/integration/" not in path)  # other integration files, then unit tests

    items.sort(key=rank)  # stable: the order within a file is kept
