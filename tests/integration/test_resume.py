"""Crash and resume a real training run (tiny preset, real vLLM, subprocesses).

One run directory goes through: a graceful SIGINT (checkpoint with work in flight, exit 0), a
SIGKILL while a checkpoint is written, a SIGKILL inside a weight sync, a SIGKILL from outside at
a random moment, and a final resume that completes. At the end the ledger shows
every prompt trained exactly once or dropped with a reason (0 lost, 0 duplicated), the metrics
hold every step once, and no engine process outlived a killed run.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from rollflow.testing import alive, engine_processes

pytestmark = pytest.mark.integration

STEPS = 10
GROUPS = 2
SETTINGS = [
    f"run.max_steps={STEPS}",
    f"run.groups_per_step={GROUPS}",
    "sampling.max_tokens=48",
    "checkpoint.every=1",
    "observe.sinks=[]",
]


class Run:
    """A training subprocess; its output is collected, and its engine processes noted while it runs."""

    def __init__(self, out: Path, *, resume: bool, fault: str | None = None) -> None:
        args = [sys.executable, "-m", "rollflow", "train", "--preset", "tiny", "--output-dir", str(out)]
        for setting in SETTINGS:
            args += ["--set", setting]
        self.proc = subprocess.Popen(
            [*args, *(["--resume"] if resume else [])],
            env={**os.environ, "ROLLFLOW_FAULT": fault or ""},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[tuple[float, str]] = []
        self.engines: set[int] = set()
        self._threads = [threading.Thread(target=self._read), threading.Thread(target=self._watch)]
        for thread in self._threads:
            thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        self.lines.extend((time.monotonic(), line) for line in self.proc.stdout)

    def _watch(self) -> None:
        while self.proc.poll() is None:
            self.engines |= set(engine_processes(self.proc.pid))
            time.sleep(0.2)

    @property
    def output(self) -> str:
        return "".join(line for _, line in self.lines)[-3000:]

    def wait_until(self, condition, what: str, timeout: float = 480) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            assert self.proc.poll() is None, f"run ended before {what} ({self.proc.returncode}):\n{self.output}"
            assert time.monotonic() < deadline, f"no {what} within {timeout} s; the run printed:\n{self.output}"
            time.sleep(0.1)

    def wait(self, timeout: float = 600) -> int:
        code = self.proc.wait(timeout=timeout)
        for thread in self._threads:
            thread.join()
        return code


def assert_gone(pids: set[int], within_s: float = 10.0) -> None:
    assert pids, "no engine process was seen"
    deadline = time.monotonic() + within_s
    while any(alive(pid) for pid in pids):
        assert time.monotonic() < deadline, f"engine processes outlived their run: {[p for p in pids if alive(p)]}"
        time.sleep(0.2)


def steps_done(out: Path) -> list[int]:
    path = out / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.exists() else []


def latest_step(out: Path) -> int:
    names = [p.name for p in (out / "checkpoints").glob("step-*")]
    return max((int(name.split("-")[1]) for name in names), default=-1)


def ledger(out: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rollflow", "ledger", str(out)], capture_output=True, text=True, check=False
    )


def audit(out: Path) -> None:
    done = ledger(out)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "duplicates: 0" in done.stdout and "missing: 0" in done.stdout


def test_killed_and_resumed_runs_train_every_prompt_exactly_once(tmp_path):
    rng = random.Random(1)
    out = tmp_path / "run"

    # 1. Graceful stop: SIGINT after a step -> checkpoint with the work in flight, exit 0.
    run = Run(out, resume=False)
    first = rng.randrange(2)
    run.wait_until(lambda: len(steps_done(out)) > first, "a training step")
    run.proc.send_signal(signal.SIGINT)
    assert run.wait() == 0, run.output
    assert "stopped after step" in run.output and "--resume" in run.output
    assert "run ended" not in (out / "ledger.jsonl").read_text()  # nothing in flight was given up

    # 2. SIGKILL at named moments: while writing a checkpoint, then inside a weight sync.
    for fault in ("checkpoint-write", "weight-sync"):
        fault = f"{fault}:{rng.randint(1, 2)}"
        run = Run(out, resume=True, fault=fault)
        assert run.wait() == -signal.SIGKILL, f"fault {fault} did not fire:\n{run.output}"
        assert_gone(run.engines)

    # 3. SIGKILL from outside at a random moment, once the resumed run has made progress.
    target = min(latest_step(out) + rng.randint(1, 2), STEPS - 2)
    run = Run(out, resume=True)
    run.wait_until(lambda: latest_step(out) >= target, f"the checkpoint of step {target}")
    time.sleep(rng.uniform(0.0, 0.5))
    run.proc.kill()
    assert run.wait() == -signal.SIGKILL, f"the run finished before it could be killed:\n{run.output}"
    assert_gone(run.engines)
    killed = ledger(out)
    assert killed.returncode == 1 and "run: crashed: process" in killed.stdout, killed.stdout + killed.stderr
    assert "`--resume` continues it from step-" in killed.stdout

    # 4. Resume to the end.
    run = Run(out, resume=True)
    assert run.wait() == 0, run.output

    assert steps_done(out) == list(range(STEPS))  # every step once, in order, across five runs
    entries = [json.loads(line) for line in (out / "ledger.jsonl").read_text().splitlines()]
    trained_steps = sorted(e["step"] for e in entries if e["outcome"] == "trained")
    assert trained_steps == sorted(list(range(STEPS)) * GROUPS)
    audit(out)
    assert not list((out / "checkpoints").glob(".*.tmp"))  # half-written checkpoints were cleaned up


def test_a_killed_engine_process_is_restarted_and_the_run_completes(tmp_path):
    out = tmp_path / "run"
    run = Run(out, resume=False)
    run.wait_until(lambda: len(steps_done(out)) >= 2, "two training steps")
    (engine_pid,) = engine_processes(run.proc.pid)
    os.kill(engine_pid, signal.SIGKILL)
    killed_at = time.monotonic()
    assert run.wait() == 0, run.output
    reported = [t for t, line in run.lines if "restarting the engine" in line]
    assert reported, run.output
    assert reported[0] - killed_at < 30, "the dead engine was not reported within 30 s"
    assert steps_done(out) == list(range(STEPS))
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["engine_restarts"] == 1
    audit(out)
    assert len(run.engines) == 2
    assert_gone(run.engines)  # the replacement was shut down with the run


def test_a_weight_update_that_does_not_land_replaces_the_engine_and_the_run_completes(tmp_path):
    """Inside the engine process the 6th repeated load silently leaves a tensor out (an injected
    fault). The fingerprint of what the trainer sent catches it, the engine is replaced with one
    given the trainer's weights, and every step is trained once."""
    out = tmp_path / "run"
    run = Run(out, resume=False, fault="load-copy:6:skip")
    assert run.wait() == 0, run.output
    said = "".join(line for _, line in run.lines)
    assert "the weights loaded are not what the trainer sent: 1 of" in said, run.output
    assert "restarting the engine (1 of" in said and "restarting the engine (2 of" not in said
    assert steps_done(out) == list(range(STEPS))
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["engine_restarts"] == 1
    audit(out)
    assert_gone(run.engines)
