"""The command line as a user runs it: a real generate run, and user errors without tracebacks."""

from __future__ import annotations

import re
import subprocess
import sys

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
