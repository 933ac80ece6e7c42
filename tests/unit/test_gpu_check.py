"""The GPU check's logic, as far as a machine without CUDA can check it: each stage bounded and
reported with its name while the next still runs, the RESULT line, the refusal without CUDA,
and the wheels it carries covering, with the lent machine's image, every package it imports."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import gpu_check  # noqa: E402

OPTIONAL = {
    "brotli": "aiohttp imports it when it is installed",
    "dill": "torch imports it when it is installed",
    "googleapis-common-protos": "shares the `google` namespace with protobuf, which the image has",
    "backports.tarfile": "owns the `backports` namespace when installed (keyring's dependency, through openenv)",
}
"""Distributions imported here only because this machine has them."""


def python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_each_stage_is_bounded_and_reported_and_the_next_one_runs(capsys):
    plan = [
        gpu_check.Stage("fine", python("print('a note'); print('{\"x\": 1.5}')"), 20),
        gpu_check.Stage("raises", python("raise RuntimeError('CUDA error: out of memory')"), 20),
        gpu_check.Stage("hangs", python("import time; time.sleep(60)"), 1),
        gpu_check.Stage("garbled", python("print('not json')"), 20),
        gpu_check.Stage("tests", python("print('3 passed'); raise SystemExit(0)"), 20, reports_json=False),
    ]
    began = time.monotonic()
    results = gpu_check.drive(plan)
    assert time.monotonic() - began < 30
    assert results["fine"] == {"ok": True, "figures": {"x": 1.5}, "s": pytest.approx(results["fine"]["s"])}
    assert results["raises"]["why"] == "exit status 1" and "out of memory" in results["raises"]["tail"]
    assert results["hangs"]["why"] == "timed out after 1 s"
    assert results["garbled"]["why"] == "its last line is not JSON"
    assert results["tests"]["ok"] and results["tests"]["figures"] == {"summary": "3 passed"}
    out = capsys.readouterr().out
    assert "stage raises: FAILED (exit status 1)" in out and "stage hangs: FAILED (timed out after 1 s)" in out
    assert "[fine] a note" in out


def test_stages_past_the_budget_are_skipped_not_started():
    plan = [gpu_check.Stage(name, python("import time; time.sleep(0.3); print('{}')"), 20) for name in "abc"]
    results = gpu_check.drive(plan, budget_s=0.1)
    assert results["a"]["ok"] and results["b"]["ok"] is False and results["c"]["why"].startswith("skipped")


def test_the_result_line_carries_the_headline_figures_and_says_which_are_missing():
    results = {
        "machine": {"ok": True, "figures": {}},
        "loss": {"ok": True, "figures": {"liger_vs_chunked_tokens_per_s": 1.8734, "chunked_logprob_err": 1e-3}},
        "layouts": {"ok": False, "why": "exit status 1"},
    }
    line = gpu_check.result_line(results)
    assert line.startswith("RESULT gpu_stages_ok=2/3 ")
    assert "liger_vs_chunked_tokens_per_s=1.873" in line and "chunked_logprob_err=0.001" in line
    assert "shared_prompt_mfu=na" in line and "d2d_gbps=na" in line


def test_the_planned_stages_are_the_documented_ones():
    assert [s.name for s in gpu_check.stages()] == ["machine", "tests", "loss", "layouts", "fsdp", "weight_update"]
    assert sum(s.timeout_s for s in gpu_check.stages()) <= 900 and gpu_check.BUDGET_S <= 480  # under 8 minutes


def test_without_cuda_the_check_says_so_at_once():
    began = time.monotonic()
    done = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh")], capture_output=True, text=True,
                          timeout=120, check=False, env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable})
    assert done.returncode == 2 and "no CUDA device on this machine" in done.stderr
    assert time.monotonic() - began < 60


def test_the_image_and_the_carried_wheels_hold_every_package_the_check_imports():
    image = {
        line.strip().lower().replace("_", "-")
        for line in (ROOT / "bench" / "gpu_image.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    script = (ROOT / "bench" / "gpu_wheels.sh").read_text()
    wheels = {part.split("==")[0].strip('"').lower() for part in script.split() if "==" in part}
    assert {"msgspec", "liger-kernel", "pytest-asyncio"} <= wheels
    code = """
import importlib.metadata as md, json, sys
sys.path[:0] = ["src", "bench", "tests"]
import rollflow, rollflow.controller, rollflow.loss, rollflow.testing, rollflow.trainer, rollflow.weight_sync.buckets
import transformers, peft, packing, gpu_check, gpu_stages, conftest, pytest, pytest_asyncio, pytest_timeout
dists = md.packages_distributions()
used = {d.lower().replace("_", "-") for m in {n.split(".")[0] for n in sys.modules} for d in dists.get(m, [])}
print(json.dumps(sorted(used)))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120,
                          check=True)
    used = set(json.loads(done.stdout.splitlines()[-1]))
    assert {"torch", "msgspec", "transformers"} <= used  # it saw the imports
    missing = used - image - wheels - set(OPTIONAL) - {"rollflow"}
    assert not missing, f"the GPU image lacks {sorted(missing)}: add them to bench/gpu_wheels.sh"


@pytest.mark.timeout(300)
def test_every_stage_runs_its_code_in_a_dry_run_on_the_cpu(monkeypatch):
    """The stages' own code, on the CPU at small sizes (a 2-layer SmolLM2, gloo, no memory figures,
    the chunked path in liger's place): what can break without a GPU breaks here, not on the
    device's short budget."""
    monkeypatch.setenv("ROLLFLOW_GPU_CHECK_DRY", "1")
    monkeypatch.setenv("PYTHONPATH", f"{ROOT / 'src'}:{ROOT / 'bench'}")
    monkeypatch.chdir(ROOT)
    results = gpu_check.drive(gpu_check.stages())
    assert {name: r["ok"] for name, r in results.items()} == dict.fromkeys(results, True), results
    layouts = results["layouts"]["figures"]
    assert layouts["shared_prompt_model_tokens"] < layouts["packed_model_tokens"] < layouts["padded_model_tokens"]
    assert results["fsdp"]["figures"]["module"].startswith("FSDP")  # one rank, sharded by FSDP2
    assert results["loss"]["figures"]["chunked_logprob_err"] < 1e-2
    assert "RESULT gpu_stages_ok=6/6" in gpu_check.result_line(results)
