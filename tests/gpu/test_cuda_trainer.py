"""The trainer's GPU paths: chunked log-probs on CUDA, bf16 steps. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from rollflow.loss import naive_token_logprobs, token_logprobs

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_logprobs_match_full_logits_on_cuda(dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    n, h, v = 512, 256, 49_152
    hidden = torch.randn(n, h, device="cuda", generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, device="cuda", generator=g) * 0.05).to(dtype).requires_grad_()
    targets = torch.randint(0, v, (n,), device="cuda", generator=g)
    got, _ = token_logprobs(hidden, weight, targets, temperature=0.8, chunk=128)
    got.sum().backward()
    grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    want = naive_token_logprobs(hidden, weight, targets, temperature=0.8)
    want.sum().backward()
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    assert torch.allclose(got, want, atol=tol, rtol=tol)
    assert torch.allclose(grads[0].float(), hidden.grad.float(), atol=tol, rtol=tol)
    assert torch.allclose(grads[1].float(), weight.grad.float(), atol=tol, rtol=tol)


def test_bf16_trainer_step_on_cuda(make_batch):

    from rollflow.config import TrainerConfig
    from rollflow.models import tiny_model_path
    from rollflow.trainer import Trainer

    trainer = Trainer(tiny_model_path(0), TrainerConfig(lr=1e-3, dtype="bfloat16"))
    assert trainer.device.type == "cuda"
    batch = make_batch(trainer)
    before = {k: v.clone() for k, v in trainer.full_weights()}
    metrics = trainer.step(batch)
    assert all(map(lambda x: x == x, metrics.values()))  # no NaN
    assert abs(metrics["ratio_mean"] - 1.0) < 0.05  # bf16 scoring vs bf16 behaviour of itself
    after = dict(trainer.full_weights())
    assert any(not torch.equal(before[k], after[k]) for k in before)
