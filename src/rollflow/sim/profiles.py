"""Default timing profiles per model size and GPU, and how each number was derived.

Engine (one replica = one GPU, vLLM, bf16, continuous batching up to 256 sequences):

| model | weights | KV per token | decode at 256 seqs × 1,024 context, one H100 | source |
|---|---|---|---|---|
| 7B  (Qwen2.5-7B shape: 28 layers, 4 KV heads × 128)  | 15.2 GB | 57 KB  | ≈ 6,300 tokens/s | vLLM throughput figures |
| 32B (Qwen2.5-32B shape: 64 layers, 8 KV heads × 128) | 65.5 GB | 262 KB | ≈ 1,200 tokens/s | vLLM throughput figures |

A step costs `fixed + per_seq × batch + per_context_token × context`: `fixed` = reading the
weights once (bytes / HBM bandwidth), `per_context_token` = reading one token's KV, and
`per_seq` is what is left of the published throughput at 256 sequences of 1,024 tokens of
context. HBM bandwidth: H100 3.35 TB/s, H200 4.8 TB/s (the H200 scales the memory terms; the
per-sequence compute is the same). Prefill: 2 × params FLOPs per prompt token at 50% of bf16
peak (989 TFLOP/s dense on both).

Trainer: forward + backward = 6 × params FLOPs per token at 40% MFU of bf16 peak, divided over
the trainer GPUs (data parallel, ideal). Weight sync: bf16 weights over NCCL at 25 GB/s (one
200 Gb/s link; the trainer's tensors are sent directly, so it waits: `snapshots = False`).

These are planning numbers, not measurements; `bench/simulator_validation.py` checks the model
against a measured CPU run (calibrated profiles, `calibrate_engine` / `calibrate_trainer`).
"""

from __future__ import annotations

from rollflow.sim.components import EngineProfile, TrainerProfile

BF16_PEAK = 989e12
HBM = {"H100": 3.35e12, "H200": 4.8e12}
MODELS = {
    # params, KV bytes per token (bf16), published decode tokens/s on one H100 at 256 seqs
    "7B": (7.6e9, 28 * 4 * 128 * 2 * 2, 6300.0),
    "32B": (32.8e9, 64 * 8 * 128 * 2 * 2, 1200.0),
}
REFERENCE_BATCH, REFERENCE_CONTEXT = 256, 1024
SYNC_BYTES_PER_S = 25e9


def engine_profile(model: str, gpu: str = "H100") -> EngineProfile:
    if model not in MODELS:
        raise ValueError(f"unknown model size {model!r}; expected one of {sorted(MODELS)}")
    if gpu not in HBM:
        raise ValueError(f"unknown GPU {gpu!r}; expected one of {sorted(HBM)}")
    params, kv_bytes, tokens_per_s = MODELS[model]
    # Derived on the H100, where the published figure was measured.
    fixed_h100 = 2 * params / HBM["H100"]
    per_ctx_h100 = kv_bytes / HBM["H100"]
    step = REFERENCE_BATCH / tokens_per_s
    per_seq = (step - fixed_h100 - per_ctx_h100 * REFERENCE_BATCH * REFERENCE_CONTEXT) / REFERENCE_BATCH
    scale = HBM["H100"] / HBM[gpu]
    return EngineProfile(
        fixed_s=fixed_h100 * scale,
        per_seq_s=per_seq,
        per_context_token_s=per_ctx_h100 * scale,
        prefill_per_token_s=2 * params / (0.5 * BF16_PEAK),
        max_num_seqs=REFERENCE_BATCH,
    )


def trainer_profile(model: str) -> TrainerProfile:
    if model not in MODELS:
        raise ValueError(f"unknown model size {model!r}; expected one of {sorted(MODELS)}")
    params = MODELS[model][0]
    weight_bytes = int(2 * params)
    return TrainerProfile(
        s_per_token=6 * params / (0.4 * BF16_PEAK),
        fixed_s=0.5,
        weight_bytes=weight_bytes,
        stage_bytes_per_s=float("inf"),
        sync_bytes_per_s=SYNC_BYTES_PER_S,
        sync_fixed_s=0.2,
        snapshots=False,
    )
