"""The GPU check's stages: each one measures a CUDA path of the trainer, in a process of its own.

`bench/gpu_check.sh` runs this file once as the driver (`drive`), which runs every stage (its code
is in `bench/gpu_stages.py`) as `python bench/gpu_check.py --stage NAME` with its own time limit,
so a stage that fails, crashes the process or hangs (a CUDA error, an NCCL wait) is reported with
its name and the next one still runs; stages are skipped once the whole check has used
`BUDGET_S`. Each stage prints one JSON object, its figures, as its last line. The driver prints a
table and, last, `RESULT gpu_stages_ok=K/N ...` with the headline figures.

Stages:
- `machine`: the device, torch, triton and liger-kernel versions.
- `tests`: `pytest tests/gpu` (the CUDA tests the suite skips without a device).
- `loss`: the LM-head log-probs of 16,384 tokens × SmolLM2's vocabulary in bf16, forward and
  backward: rollflow's chunked path (`rollflow.loss.token_logprobs`), liger-kernel's fused linear
  cross entropy, and full logits; peak memory, tokens/s, and the log-probs' and gradients'
  agreement with the full-logits reference (relative to its scale).
- `layouts`: one bf16 training step of SmolLM2-135M's architecture through rollflow's `Trainer`
  in each layout (padded, packed, shared prompt) on a GRPO batch (8 groups of 8, 256-token
  prompts, completions lognormal mean 300 ≤ 1,024): model tokens/s, MFU and peak memory; then the
  shared-prompt step with liger-kernel's fused loss in place of the chunked one (what wiring it in
  would give), and the two steps' log-probs compared. The weights are random: SmolLM2's 270 MB
  of weights exceed what a device call carries, and speed, memory and agreement do not depend on
  their values.
- `fsdp`: the same step with the model sharded by FSDP2 over a one-rank NCCL group, and the
  weights gathered whole afterwards.
- `weight_update`: the trainer side of a weight update: the weights gathered and packed into the
  transfer buckets (`rollflow.weight_sync.buckets.pack_into`) in GPU memory and in pinned host
  memory, against one device-to-device copy of the same bytes.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpu_stages import STAGES

BUDGET_S = 420.0
"""Seconds the whole check may use; stages not started by then are reported skipped."""


@dataclass(frozen=True)
class Stage:
    name: str
    argv: list[str]
    timeout_s: float
    reports_json: bool = True
    """The stage prints its figures as JSON last; otherwise its exit status and last line are all."""


def stages() -> list[Stage]:
    me = [sys.executable, str(Path(__file__).resolve()), "--stage"]
    tests = [sys.executable, "-m", "pytest", "tests/gpu", "-q", "-p", "no:cacheprovider"]
    limits = {"machine": 60, "loss": 120, "layouts": 240, "fsdp": 150, "weight_update": 120}
    first = [Stage("machine", [*me, "machine"], limits.pop("machine")), Stage("tests", tests, 180, reports_json=False)]
    return first + [Stage(name, [*me, name], limit) for name, limit in limits.items()]


def run_stage(stage: Stage) -> dict[str, Any]:
    """One stage in its own process: its figures, or the reason it has none."""
    began = time.monotonic()
    try:
        done = subprocess.run(stage.argv, capture_output=True, text=True, timeout=stage.timeout_s, check=False)
    except subprocess.TimeoutExpired as err:
        tail = (err.stderr or b"")[-600:]
        tail = tail.decode(errors="replace") if isinstance(tail, bytes) else tail
        return {"ok": False, "why": f"timed out after {stage.timeout_s:g} s", "tail": tail, "s": stage.timeout_s}
    seconds = time.monotonic() - began
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    if not stage.reports_json:
        summary = lines[-1] if lines else ""
        if done.returncode != 0:
            return {"ok": False, "why": f"exit status {done.returncode}: {summary}", "tail": done.stdout[-1500:],
                    "s": seconds}
        return {"ok": True, "figures": {"summary": summary}, "s": seconds}
    if done.returncode != 0 or not lines:
        return {"ok": False, "why": f"exit status {done.returncode}", "tail": done.stderr[-1500:], "s": seconds}
    try:
        figures = json.loads(lines[-1])
    except json.JSONDecodeError:
        return {"ok": False, "why": "its last line is not JSON", "tail": lines[-1][-300:], "s": seconds}
    for line in lines[:-1]:
        print(f"  [{stage.name}] {line}")
    return {"ok": True, "figures": figures, "s": seconds}


def drive(plan: list[Stage], budget_s: float = BUDGET_S) -> dict[str, dict[str, Any]]:
    """Every stage in order, each bounded, each failure printed with its stage; the results."""
    began = time.monotonic()
    results: dict[str, dict[str, Any]] = {}
    for stage in plan:
        if time.monotonic() - began > budget_s:
            results[stage.name] = {"ok": False, "why": f"skipped: the check's {budget_s:g} s were used", "s": 0.0}
        else:
            print(f"stage {stage.name} (at most {stage.timeout_s:g} s) ...", flush=True)
            results[stage.name] = run_stage(stage)
        result = results[stage.name]
        if result["ok"]:
            print(f"stage {stage.name}: ok in {result['s']:.1f} s: {json.dumps(result['figures'])}", flush=True)
        else:
            print(f"stage {stage.name}: FAILED ({result['why']})", flush=True)
            if result.get("tail"):
                print("  " + result["tail"].strip().replace("\n", "\n  "), flush=True)
    return results


HEADLINE = {
    "loss": ("liger_vs_chunked_tokens_per_s", "liger_vs_chunked_peak_mem", "chunked_logprob_err", "liger_logprob_err"),
    "layouts": ("shared_prompt_tokens_per_s", "shared_prompt_mfu", "packed_tokens_per_s", "padded_tokens_per_s",
                "liger_step_vs_chunked"),
    "fsdp": ("fsdp_step_s",),
    "weight_update": ("pack_gpu_vs_d2d", "pack_pinned_gbps", "d2d_gbps"),
}
"""The figures the RESULT line carries, by stage."""


def result_line(results: dict[str, dict[str, Any]]) -> str:
    ok = sum(r["ok"] for r in results.values())
    parts = [f"gpu_stages_ok={ok}/{len(results)}"]
    for stage, keys in HEADLINE.items():
        figures = results.get(stage, {}).get("figures", {})
        for key in keys:
            value = figures.get(key)
            parts.append(f"{key}={value:.4g}" if isinstance(value, (int, float)) else f"{key}=na")
    return "RESULT " + " ".join(parts)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", choices=sorted(STAGES), help="run one stage and print its figures as JSON")
    args = parser.parse_args()
    if args.stage:
        print(json.dumps(STAGES[args.stage]()), flush=True)
        return 0
    results = drive(stages())
    print(result_line(results))
    return 0 if all(r["ok"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
