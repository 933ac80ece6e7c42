"""The command line as a user runs it: a real generate run, and user errors without tracebacks."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


def run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rollflow", *args], capture_output=True, text=True, timeout=timeout, check=False
    )


def test_generate_on_the_tiny_preset_reports_accuracy_and_throughput():
    done = run("generate", "--preset", "tiny", "--prompts", "3", "--set", "sampling.max_tokens=8")
    assert done.returncode == 0, done.stderr[-2000:]
    line = done.stdout.strip().splitlines()[-1]
    assert re.fullmatch(
        r"model=tiny task=arithmetic prompts=3 samples=12 accuracy=0\.\d{3} pass@4=[01]\.\d{3} "
        r"tokens=\d+ wall_s=[\d.]+ tokens_per_s=\d+",
        line,
    ), line
    tokens = int(re.search(r"tokens=(\d+)", line).group(1))
    assert 12 <= tokens <= 12 * 8
    assert not third_party_lines(done.stdout + done.stderr)


def test_eval_plays_a_tasksets_held_out_tasks_as_episodes_scored_by_their_tasks():
    folder = Path(__file__).parents[2] / "examples" / "environments"
    env = {**os.environ, "PYTHONPATH": f"{folder}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run(
        [sys.executable, "-m", "rollflow", "eval", "--preset", "tiny", "--prompts", "3", "--pass-k", "2",
         "--set", "sampling.max_tokens=8", "--set", "env.kind=verifiers", "--set", "env.taskset=sums-taskset",
         "--set", "env.taskset_args={n = 8}"],
        capture_output=True, text=True, timeout=300, check=False, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["env"] == "verifiers" and "task" not in report  # the taskset's prompts, not data.task's
    assert report["prompts"] == 3 and report["k"] == 2 and report["versions"] == [0]
    assert report["unscorable"] == 0 and 0.0 <= report["accuracy"] <= 1.5  # the tasks' weights: 1 + 0.5


OWN_LINES = re.compile(
    r"(step \d+/\d+  reward .*"  # the progress line
    r"|[a-z][a-zA-Z0-9 ./_-]* \.\.\."  # what the run waits for
    r"|steps=\d+ .*|trained model: .*|held-out accuracy .*"  # the summary
    r"|What is .* reward=\d.*|model=tiny task=.*)"  # generate's examples and summary
)


def third_party_lines(output: str) -> list[str]:
    """Lines that are not rollflow's own (warnings, progress bars, tracebacks of libraries)."""
    return [line for line in output.splitlines() if line.strip() and not OWN_LINES.fullmatch(line)]


@pytest.mark.timeout(300)
def test_a_normal_training_run_prints_only_its_own_lines_and_leaves_the_trained_model(tmp_path):
    """No third-party warning, progress bar or exit traceback on the console (vLLM's, torch's,
    transformers'): each one's cause was removed or it is filtered as harmless (`-v` shows them)."""
    done = run("train", "--preset", "tiny", "--max-steps", "2", "--set", "run.eval_prompts=2",
               "--output-dir", str(tmp_path / "run"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert third_party_lines(done.stdout + done.stderr) == []
    assert "trained model: " in done.stdout and (tmp_path / "run" / "final" / "model.safetensors").is_file()
    assert "starting the vLLM engine ..." in done.stderr


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["generate", "--set", "engine.max_num_seq=3"], "unknown key `engine.max_num_seq`"),
        (["generate", "--set", "model.path=/no/such/model"], "model.path '/no/such/model': does not exist"),
        (["generate", "--preset", "huge"], "unknown preset 'huge'"),
        (
            ["generate", "--set", "data.task=jsonl", "--set", "data.paths=['/no/file.jsonl']"],
            "/no/file.jsonl: cannot read dataset file",
        ),
        (["generate", "--prompts", "0"], "--prompts: expected a positive number"),
        (["train-everything"], "invalid choice: 'train-everything'"),
    ],
)
def test_user_errors_exit_2_with_one_clear_line(args, expected):
    done = run(*args, timeout=120)
    assert done.returncode == 2
    assert expected in done.stderr
    assert "Traceback" not in done.stderr


def test_train_refuses_an_output_directory_that_holds_a_run(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    done = run("train", "--preset", "tiny", "--output-dir", str(tmp_path), timeout=120)
    assert done.returncode == 2
    assert "already holds a run" in done.stderr and "Traceback" not in done.stderr


def test_a_group_size_that_cannot_fit_in_memory_is_refused_before_anything_is_written(tmp_path):
    out = tmp_path / "run"
    done = run("train", "--preset", "tiny", "--set", "rollout.group_size=100000", "--output-dir", str(out),
               timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "rollout.group_size: 100000" in done.stderr and "800,000 samples in flight" in done.stderr
    assert "Traceback" not in done.stderr and not out.exists()


def left_behind(temp: Path) -> list[Path]:
    """Sockets anywhere under `temp`, and rollflow's own entries (torch's compile cache may stay)."""
    return [p for p in temp.rglob("*") if p.is_socket() or p.name.startswith("rollflow")]


@pytest.fixture
def short_temp():
    """A temp directory for a run, with a short path (a Unix socket's path must fit in 107 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="rf-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_a_reward_that_always_raises_ends_the_run_naming_it(tmp_path, short_temp):
    (tmp_path / "broken_reward.py").write_text(
        "def boom(prompts, completions, **kwargs):\n    raise RuntimeError('boom')\n"
    )
    began = time.monotonic()
    temp = short_temp  # the run's temp directory: nothing may be left in it
    done = subprocess.run(
        [sys.executable, "-m", "rollflow", "train", "--preset", "tiny", "--output-dir", str(tmp_path / "run"),
         "--set", 'scoring.rewards=[{name = "boom", function = "broken_reward:boom"}]'],
        capture_output=True, text=True, timeout=300, check=False, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(tmp_path), "TMPDIR": str(temp)},
    )
    elapsed = time.monotonic() - began
    assert done.returncode == 1, done.stderr[-2000:]
    assert "the run cannot learn" in done.stderr and "reward boom: raised RuntimeError: boom ×16" in done.stderr
    assert elapsed < 150, f"{elapsed:.0f} s (the engine starts in 20-60 s; the rule then fires within seconds)"
    ledger = (tmp_path / "run" / "ledger.jsonl").read_text().splitlines()
    assert 16 <= len(ledger) < 40  # the ledger stops growing once the rule fires
    assert left_behind(temp) == [], "the run left sockets or files of its own in its temp directory"


def test_over_long_prompts_are_dropped_and_a_second_run_on_the_directory_is_refused(tmp_path, short_temp):
    """Real vLLM refuses a prompt longer than its context; the run drops those prompts with the
    reason and trains to max_steps. A `--resume` on its directory while it runs is refused at once:
    it is started as soon as the live run holds the directory, which is before the live run's
    engine starts (15-60 s), and is refused in a few seconds."""
    from rollflow.rundir import lock_holder

    steps = 8
    data = tmp_path / "data.jsonl"
    rows = [{"prompt": "word " * 1500 if i % 3 == 0 else f"Say {i} in digits."} for i in range(12)]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "run"
    args = [sys.executable, "-m", "rollflow", "train", "--preset", "tiny", "--output-dir", str(out),
            "--set", f"run.max_steps={steps}", "--set", 'data.task="jsonl"', "--set", f'data.paths=["{data}"]']
    temp = short_temp  # the run's temp directory: nothing may be left in it
    live = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "TMPDIR": str(temp)})
    deadline = time.monotonic() + 120
    while lock_holder(out) is None:
        assert live.poll() is None, live.communicate()[0][-3000:]
        assert time.monotonic() < deadline, "the run did not take its directory within 120 s"
        time.sleep(0.1)
    second = subprocess.run([*args, "--resume"], capture_output=True, text=True, timeout=120, check=False)
    assert live.poll() is None, "the live run ended before the second one could try its directory"
    assert second.returncode == 2, second.stderr[-2000:]
    assert f"another rollflow run is using this directory (process {live.pid})" in second.stderr
    output, _ = live.communicate(timeout=300)
    assert live.returncode == 0, output[-3000:]
    entries = [json.loads(line) for line in (out / "ledger.jsonl").read_text().splitlines()]
    too_long = [e for e in entries if e.get("reason", "").startswith("prompt too long")]
    assert too_long and all("engine.max_model_len = 1024" in e["reason"] for e in too_long)
    assert len([e for e in entries if e["outcome"] == "trained"]) == steps * 4
    assert left_behind(temp) == [], "the run left sockets or files of its own in its temp directory"
    audit = run("ledger", str(out))
    assert audit.returncode == 0 and f"run: finished ({steps} steps)" in audit.stdout, audit.stdout + audit.stderr


def test_a_reward_that_hangs_does_not_keep_the_process_alive(tmp_path):
    """Every call of a sync reward hangs: each times out (unscorable), the stop rule ends the run,
    and the process exits at once, not when the hung calls return."""
    (tmp_path / "stuck_reward.py").write_text(
        "import time\n\ndef stuck(prompts, completions, **kwargs):\n    time.sleep(600)\n"
    )
    began = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "rollflow", "train", "--preset", "tiny", "--output-dir", str(tmp_path / "run"),
         "--set", 'scoring.rewards=[{name = "stuck", function = "stuck_reward:stuck", timeout_s = 1}]'],
        capture_output=True, text=True, timeout=240, check=False, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
    )
    elapsed = time.monotonic() - began
    assert done.returncode == 1, done.stderr[-2000:]
    assert "reward stuck: timed out after 1 s" in done.stderr, done.stderr[-2000:]
    assert elapsed < 150, f"{elapsed:.0f} s"


def test_one_sigterm_ends_a_run_whose_agents_hang_within_15_s(tmp_path):
    """One episode in eight has a sync agent that blocks for good (the others make one ordinary
    call): the run goes on training past the hung calls, and one SIGTERM ends the process within
    15 s, its hung threads never waited for, with status.json saying it stopped. (A step that can
    never end is `tests/unit/test_signals.py`'s case.)"""
    (tmp_path / "hung_agent.py").write_text(textwrap.dedent(f"""
        import itertools, os, time
        import openai

        calls = itertools.count()

        def agent(task, base_url):
            if next(calls) % 8 == 7:
                with open({str(tmp_path / "hung")!r}, "a") as marks:
                    marks.write("x")
                time.sleep(3600)
            with openai.OpenAI(base_url=base_url, api_key=task.api_key, max_retries=0) as client:
                client.chat.completions.create(model=task.model, messages=task.messages, max_tokens=4)
            return 1.0
    """))
    proc = subprocess.Popen(
        [sys.executable, "-m", "rollflow", "train", "--preset", "tiny", "--output-dir", str(tmp_path / "run"),
         "--max-steps", "1000", "--set", "env.kind=agent", "--set", "env.function=hung_agent:agent",
         "--set", "env.episode_timeout_s=2", "--set", "sampling.max_tokens=4"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
    )  # fmt: skip
    hung = tmp_path / "hung"
    try:
        deadline = time.monotonic() + 240
        while not (hung.exists() and len(hung.read_text()) >= 10):  # more hung calls than a default pool's threads
            assert proc.poll() is None, proc.communicate()[1][-2000:]
            assert time.monotonic() < deadline, "fewer than 10 hung calls in 240 s"
            time.sleep(0.5)
        time.sleep(3.0)
        began = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        elapsed = time.monotonic() - began
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert elapsed < 15, f"{elapsed:.1f} s after SIGTERM; {err[-2000:]}"
    assert proc.returncode in (0, 130), err[-2000:]
    assert re.search(r"step \d+/1000", err), err[-2000:]
    status = json.loads((tmp_path / "run" / "status.json").read_text())
    assert status["state"] == "stopped", status
