"""Bad input and misuse, one row per case, on the fake engine and trainer: what the run does
(trains to the end, or stops with an error naming the cause), within what time, and what is left
on disk. The same cases through the command line with real vLLM are in
tests/integration/test_cli.py."""

from __future__ import annotations

import asyncio
import json
import math
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from rollflow.config import load_config
from rollflow.controller import Controller
from rollflow.controller.setup import Given
from rollflow.envs import EnvStep, Message
from rollflow.errors import EngineError, TrainingError, UserInputError
from rollflow.ledger import summarize
from rollflow.models import load_tokenizer, tiny_model_path
from rollflow.testing import FakeEngine, FakeTokenizer, FakeTrainer, NullTransport


def boom(prompts, completions, **kwargs):
    raise RuntimeError("boom")


def too_few(prompts, completions, **kwargs):
    return [1.0]


def nan(prompts, completions, **kwargs):
    return [math.nan] * len(completions)


def strings(prompts, completions, **kwargs):
    return ["1.0"] * len(completions)


def flaky(prompts, completions, **kwargs):  # a third of the samples fail, as with a flaky server
    return [None if i % 3 == 0 else float(len(c) % 5) for i, c in enumerate(completions)]


class RaisingReset:
    async def reset(self, prompt):
        raise ValueError("no such puzzle")

    async def step(self, turn):
        return EnvStep(done=True)


class NoneStep:
    async def reset(self, prompt):
        return [Message(role="user", content="go")]

    async def step(self, turn):
        return None


@dataclass
class Case:
    name: str
    overrides: list[str] = field(default_factory=list)
    rewards: dict[str, Any] = field(default_factory=dict)
    env: Any = None
    rows: list[dict[str, Any]] | None = None
    """A JSONL dataset (task = "jsonl")."""
    error: str | None = None
    """Words the run's error must contain (besides that the run cannot learn); None: it trains
    to max_steps."""
    within_s: float = 30.0

    @property
    def tokenizer(self) -> Any:
        # Episodes render chat templates: a real tokenizer (the tiny model's, built locally).
        return load_tokenizer(tiny_model_path(0)) if self.env is not None else FakeTokenizer()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens once the socket is closed


LONG = "x" * 2000  # 2,000 tokens with the fake tokenizer: over engine.max_model_len = 1024

CASES = [
    Case("a reward that always raises", rewards={"boom": boom},
         error="reward boom: raised RuntimeError: boom ×16"),
    Case("a reward with too few values", rewards={"short": too_few}, error="reward short: returned 1 values for 4"),
    Case("a reward that returns NaN", rewards={"nan": nan}, error="reward nan: returned nan"),
    Case("a reward that returns strings", rewards={"s": strings}, error="reward s: returned '1.0' (str)"),
    Case("a reward server that is down", overrides=[
        f'scoring.rewards=[{{name = "srv", url = "http://127.0.0.1:{closed_port()}", max_retries = 0}}]'],
         error="unscorable: reward srv:"),
    Case("an environment whose reset raises", env=RaisingReset,
         error="environment: reset raised ValueError: no such puzzle"),
    Case("an environment whose step returns None", env=NoneStep,
         error="environment: step returned None (NoneType), expected an EnvStep"),
    Case("a verifier without answers", overrides=["run.reward=verifier"],
         rows=[{"prompt": f"question {i}"} for i in range(8)], error="unscorable"),
    Case("every prompt too long for the context", rows=[{"prompt": LONG + str(i)} for i in range(8)],
         error="prompt too long: 2001 tokens leave no room to generate in engine.max_model_len = 1024"),
    Case("a few prompts too long", rows=[{"prompt": LONG if i % 4 == 0 else f"q{i}"} for i in range(40)]),
    Case("a flaky reward (some samples fail)", rewards={"flaky": flaky}),
    Case("a stop rule set by hand", overrides=["run.max_dropped_in_a_row=3"], rewards={"boom": boom},
         error="cannot learn: 3 groups in a row"),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
async def test_bad_input(tmp_path, case):
    overrides = ["run.max_steps=4", "sampling.max_tokens=8", "checkpoint.every=2", *case.overrides]
    if case.rows is not None:
        data = tmp_path / "data.jsonl"
        data.write_text("".join(json.dumps(row) + "\n" for row in case.rows))
        overrides += ['data.task="jsonl"', f'data.paths=["{data}"]']
    if case.rewards:
        overrides += ["scoring.rewards=[" + ", ".join(f'{{name = "{n}"}}' for n in case.rewards) + "]"]
    out = tmp_path / "run"
    controller = Controller(
        load_config(preset="tiny", overrides=overrides),
        out,
        reward_funcs=case.rewards or None,
        env=case.env,
        given=Given(engine=FakeEngine(), trainer=FakeTrainer(), transport=NullTransport(), tokenizer=case.tokenizer),
    )
    began = time.monotonic()
    if case.error is None:
        result = await asyncio.wait_for(controller.run(), case.within_s)
        assert result.steps == 4
    else:
        with pytest.raises(TrainingError, match="the run cannot learn") as raised:
            await asyncio.wait_for(controller.run(), case.within_s)
        assert case.error in str(raised.value)
        assert "--resume continues it" in str(raised.value)
    assert list((out / "checkpoints").glob("step-*")), "the run left no checkpoint"
    assert time.monotonic() - began < case.within_s
    ledger = (out / "ledger.jsonl").read_text().splitlines()
    assert len(ledger) < 200, "the ledger grew while nothing trained"


async def test_a_stopped_run_that_could_not_learn_resumes_once_fixed(tmp_path):
    """The stop rule's checkpoint is a normal one: with the reward fixed, --resume trains on."""
    config = load_config(preset="tiny", overrides=["run.max_steps=3", "sampling.max_tokens=8",
                                                   'scoring.rewards=[{name = "r"}]'])

    def controller(reward, resume):
        return Controller(
            config,
            tmp_path,
            reward_funcs={"r": reward},
            resume=resume,
            given=Given(
                engine=FakeEngine(),
                trainer=FakeTrainer(),
                transport=NullTransport(),
                tokenizer=FakeTokenizer(),
            ),
        )

    with pytest.raises(TrainingError, match="cannot learn"):
        await asyncio.wait_for(controller(boom, False).run(), 30)
    result = await asyncio.wait_for(controller(flaky, True).run(), 30)
    assert result.steps == 3
    entries = [json.loads(line) for line in Path(tmp_path / "ledger.jsonl").read_text().splitlines()]
    assert len([e for e in entries if e["outcome"] == "trained"]) == 3 * 4


def fake_controller(config, out, *, resume=False, engine=None, **kwargs):
    return Controller(
        config,
        out,
        resume=resume,
        **kwargs,
        given=Given(
            engine=engine or FakeEngine(),
            trainer=FakeTrainer(),
            transport=NullTransport(),
            tokenizer=FakeTokenizer(),
        ),
    )


async def test_a_second_run_on_a_live_runs_directory_is_refused_at_once_and_the_live_run_stays_clean(tmp_path):
    config = load_config(preset="tiny", overrides=["run.max_steps=6", "sampling.max_tokens=8", "checkpoint.every=1"])
    live = asyncio.create_task(fake_controller(config, tmp_path, engine=FakeEngine(token_delay=0.01)).run())
    while not (tmp_path / "metrics.jsonl").exists() or not (tmp_path / "metrics.jsonl").read_text():
        await asyncio.sleep(0.01)
    assert summarize(tmp_path).run == f"still running (process {os.getpid()}); audit it once it ends"
    for resume in (True, False):
        began = time.monotonic()
        busy = rf"another rollflow run is using this directory \(process {os.getpid()}\)"
        with pytest.raises(UserInputError, match=busy):
            await fake_controller(config, tmp_path, resume=resume).run()
        assert time.monotonic() - began < 2
    result = await asyncio.wait_for(live, 60)
    assert result.steps == 6
    assert summarize(tmp_path).ok and summarize(tmp_path).run == "finished (6 steps)"
    entries = [json.loads(line) for line in (tmp_path / "ledger.jsonl").read_text().splitlines()]
    trained = [e["id"] for e in entries if e["outcome"] == "trained"]
    assert len(trained) == len(set(trained)) == 6 * 4  # nothing cut back, nothing written twice
    # The lock went with the run: the directory can be resumed now (and refuses more steps plainly).
    with pytest.raises(UserInputError, match="already did 6 steps"):
        await fake_controller(config, tmp_path, resume=True).run()


class EngineThatWillNotStart(FakeEngine):
    async def start(self):
        raise EngineError("the engine would not start")


@pytest.mark.parametrize("resume", [False, True], ids=["rerun", "resume"])
async def test_a_run_that_failed_before_its_first_step_can_be_started_again(tmp_path, resume):
    config = load_config(preset="tiny", overrides=["run.max_steps=2", "sampling.max_tokens=8"])
    with pytest.raises(EngineError, match="would not start"):
        await fake_controller(config, tmp_path, engine=EngineThatWillNotStart()).run()
    assert (tmp_path / "ledger.jsonl").exists()
    result = await asyncio.wait_for(fake_controller(config, tmp_path, resume=resume).run(), 30)
    assert result.steps == 2


async def test_an_output_path_that_is_a_file_is_refused_naming_it(tmp_path):
    config = load_config(preset="tiny")
    path = tmp_path / "taken"
    path.write_text("not a directory")
    with pytest.raises(UserInputError, match=rf"{path}: is a file, not a directory"):
        await fake_controller(config, path).run()
    assert path.read_text() == "not a directory"


async def test_the_ledger_audit_tells_a_finished_run_from_a_stopped_or_killed_one(tmp_path):
    config = load_config(preset="tiny", overrides=["run.max_steps=4", "sampling.max_tokens=8"])
    controller = fake_controller(config, tmp_path, engine=FakeEngine(token_delay=0.01))
    controller.on_step = lambda row: controller.request_stop() if row["step"] == 1 else None
    result = await asyncio.wait_for(controller.run(), 60)
    assert result.stopped
    stopped = summarize(tmp_path)
    assert not stopped.ok and stopped.missing == [] and stopped.duplicates == []
    assert stopped.run.startswith("stopped after 2 steps; `--resume` continues it from step-")
    # A process killed outright leaves `running` behind and no holder of the run lock.
    status = (tmp_path / "status.json").read_text()
    (tmp_path / "status.json").write_text(status.replace('"stopped"', '"running"'))
    assert summarize(tmp_path).run.startswith(f"crashed: process {os.getpid()} ended without a word")
    result = await asyncio.wait_for(fake_controller(config, tmp_path, resume=True).run(), 60)
    assert summarize(tmp_path).ok and summarize(tmp_path).run == "finished (4 steps)"


async def test_an_engine_server_that_cannot_be_reached_fails_naming_its_url(caplog, monkeypatch):
    from rollflow.config import EngineConfig
    from rollflow.engine import remote
    from rollflow.engine.remote import RemoteEngine

    # No such host: at once, whatever the start timeout.
    began = time.monotonic()
    with pytest.raises(EngineError, match=r"vLLM server http://no-such-host\.invalid:8000: cannot resolve its host"):
        await RemoteEngine("http://no-such-host.invalid:8000", EngineConfig(start_timeout_s=300)).start()
    assert time.monotonic() - began < 15
    # Nothing listening: the start waits (a server may still be loading), saying what it waits for.
    url = f"http://127.0.0.1:{closed_port()}"
    monkeypatch.setattr(remote, "WAIT_REPORT_S", 0.5)
    with pytest.raises(EngineError, match=rf"vLLM server {url} did not answer /health within 2 s .*last: /health"):
        await RemoteEngine(url, EngineConfig(start_timeout_s=2)).start()
    assert any(f"waiting for vLLM server {url}" in r.getMessage() for r in caplog.records)


async def test_a_stop_request_ends_the_run_within_seconds_while_a_reward_call_hangs(tmp_path):
    """The first Ctrl-C does not wait for a step that cannot come: the rewards of every sample
    hang (within their 600 s timeout), the run stops at once with a checkpoint of its work."""
    import threading

    release = threading.Event()

    def stuck(prompts, completions, **kwargs):
        release.wait(600)
        return [1.0] * len(completions)

    config = load_config(preset="tiny", overrides=["run.max_steps=4", "sampling.max_tokens=8",
                                                   'scoring.rewards=[{name = "stuck", timeout_s = 600}]'])
    controller = fake_controller(config, tmp_path, reward_funcs={"stuck": stuck})
    run = asyncio.create_task(controller.run())
    try:
        while not (tmp_path / "ledger.jsonl").exists():
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)  # the first calls are hanging now
        began = time.monotonic()
        controller.request_stop()
        result = await asyncio.wait_for(run, 30)
        assert time.monotonic() - began < 10
        assert result.stopped and result.steps == 0
        assert list((tmp_path / "checkpoints").glob("step-*")), "no checkpoint of the work in flight"
    finally:
        release.set()


KILLED_BEFORE_A_CHECKPOINT = """
import asyncio, os, signal, sys
from rollflow.config import load_config
from rollflow.controller import Controller
from rollflow.controller.setup import Given
from rollflow.testing import FakeEngine, FakeTokenizer, FakeTrainer, NullTransport

config = load_config(preset="tiny", overrides=["run.max_steps=6", "sampling.max_tokens=8", "observe.sinks=[]"])
fakes = Given(engine=FakeEngine(), trainer=FakeTrainer(), transport=NullTransport(), tokenizer=FakeTokenizer())
controller = Controller(config, sys.argv[1], given=fakes)
controller.on_step = lambda row: row["step"] == 1 and os.kill(os.getpid(), signal.SIGKILL)
asyncio.run(controller.run())
"""


@pytest.mark.parametrize("resume", [False, True], ids=["rerun", "resume"])
async def test_a_run_killed_before_its_first_checkpoint_gets_advice_that_works(tmp_path, resume):
    """kill -9 after two steps and no checkpoint: the audit's advice (rerun it, with or without
    --resume) works, starting the run over, and the killed attempt's logs are kept aside."""
    import subprocess
    import sys

    out = tmp_path / "run"
    killed = subprocess.run([sys.executable, "-c", KILLED_BEFORE_A_CHECKPOINT, str(out)], timeout=120)
    assert killed.returncode == -9 and not (out / "checkpoints").exists()
    advice = summarize(out).run
    assert advice.startswith("crashed:") and "rerun the same command (with or without --resume)" in advice
    config = load_config(preset="tiny", overrides=["run.max_steps=3", "sampling.max_tokens=8"])
    result = await asyncio.wait_for(fake_controller(config, out, resume=resume).run(), 60)
    assert result.steps == 3 and result.first_step == 0
    assert summarize(out).ok and summarize(out).run == "finished (3 steps)"
    (kept,) = (out / "attempts").iterdir()
    assert len((kept / "metrics.jsonl").read_text().splitlines()) == 2  # the killed attempt's two steps


def test_an_env_kind_that_is_not_a_string_is_refused_naming_the_field(tmp_path):
    """Found by the config fuzz test: `kind = []` raised TypeError (unhashable) instead of a
    ConfigError naming the file and the field."""
    from rollflow.config import load_config
    from rollflow.errors import ConfigError

    path = tmp_path / "run.toml"
    path.write_text("[model]\n[env]\nkind = []\n")
    with pytest.raises(ConfigError, match=r"run.toml: env.kind: expected a string"):
        load_config(path)
