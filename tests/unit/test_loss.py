"""Losses and chunked log-probs against hand-computed values and the naive computation."""

from __future__ import annotations

import math

import pytest
import torch

from rollflow.loss import (
    LossSpec,
    importance_weights,
    naive_token_logprobs,
    policy_loss,
    support_mask,
    token_logprobs,
)


def _inputs(n: int, h: int, v: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=torch.float32, requires_grad=True)
    weight = torch.randn(v, h, generator=g, dtype=torch.float32, requires_grad=True)
    targets = torch.randint(0, v, (n,), generator=g)
    return hidden, weight, targets


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Within 1e-4 in float32, relative to the tensor's scale: a gradient summed over 49,152 vocabulary
    terms in another order differs by up to ~1.3e-5 of its scale (measured on an AVX2 CPU;
    float32's eps × sqrt(49,152) ≈ 2.6e-5 is the expected size), so 1e-4 holds for any order."""
    return (a - b).abs().max().item() <= 1e-4 * max(1.0, b.abs().max().item())


@pytest.mark.parametrize(
    ("n", "h", "v", "chunk", "settings"),
    [
        (37, 16, 50, 1, {}),
        (37, 16, 50, 7, {"temperature": 0.7}),
        (37, 16, 50, 37, {"temperature": 1.3, "top_k": 5}),
        (37, 16, 50, 100, {"top_p": 0.9}),
        (24, 8, 49_152, 5, {"temperature": 0.8, "top_k": 50, "top_p": 0.95}),
        (24, 8, 49_152, 1024, {}),
    ],
)
def test_chunked_logprobs_and_grads_equal_naive(n, h, v, chunk, settings):
    hidden, weight, targets = _inputs(n, h, v)
    # Targets must lie in the support for a finite log-prob: sample them from it.
    with torch.no_grad():
        logits = (hidden @ weight.t()) / settings.get("temperature", 1.0)
        keep = support_mask(logits, settings.get("top_k", 0), settings.get("top_p", 1.0))
        if keep is not None:
            logits = logits.masked_fill(~keep, float("-inf"))
        targets = torch.multinomial(torch.softmax(logits, -1), 1, generator=torch.Generator().manual_seed(1))[:, 0]
    upstream = torch.randn(n, generator=torch.Generator().manual_seed(2))
    got, entropy = token_logprobs(hidden, weight, targets, chunk=chunk, **settings)
    (got * upstream).sum().backward()
    grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    want = naive_token_logprobs(hidden, weight, targets, **settings)
    (want * upstream).sum().backward()
    assert close(got, want)
    assert close(grads[0], hidden.grad)
    assert close(grads[1], weight.grad)
    assert (entropy >= 0).all() and entropy.requires_grad is False


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_a_bfloat16_backward_keeps_the_log_probs_and_rounds_its_inputs_not_its_logits(temperature):
    """`backward_dtype=bfloat16` (autocast's): the forward's log-probs and entropies are the float32
    ones, bit for bit; the gradients are float32's for the inputs rounded to bfloat16, within a
    fraction of a percent. Each row's top logit here is 40, which bfloat16 holds to a multiple of
    0.25 (a probability off by up to 13 %): rounding the logits themselves, not each logit minus its
    row's largest, puts the gradients ~2.7 % off."""
    n, h, v = 64, 64, 4096
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(n, h, generator=g)
    weight = torch.randn(v, h, generator=g) * 0.7
    hidden = hidden * (40 * temperature / (hidden @ weight.t()).amax(-1, keepdim=True))
    probs = torch.softmax(hidden @ weight.t() / temperature, -1)
    targets = torch.multinomial(probs, 1, generator=g)[:, 0]
    upstream = torch.randn(n, generator=g)
    # The head rounds hidden / temperature, so the reference rounds that too.
    rounded = ((hidden / temperature).bfloat16().float() * temperature, weight.bfloat16().float())
    results = []
    for dtype, (x0, w0) in ((None, (hidden, weight)), (torch.bfloat16, (hidden, weight)), (None, rounded)):
        x, w = x0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
        lp, entropy = token_logprobs(x, w, targets, temperature=temperature, chunk=16, backward_dtype=dtype)
        (lp * upstream).sum().backward()
        results.append((lp.detach(), entropy, x.grad, w.grad))
    (lp32, ent32, _, _), (lp16, ent16, gx16, gw16), (_, _, gx_want, gw_want) = results
    assert torch.equal(lp16, lp32) and torch.equal(ent16, ent32)
    for name, got, want in (("hidden", gx16, gx_want), ("weight", gw16, gw_want)):
        error = float((got - want).norm() / want.norm())
        assert error <= 0.008, f"{name} gradient off by {error:.3g} of its norm"
    # A truncated distribution keeps float32 in the backward: its support is the forward's.
    x = hidden.clone().requires_grad_(True)
    lp, _ = token_logprobs(x, weight, targets, temperature=temperature, top_k=50, backward_dtype=torch.bfloat16)
    lp.sum().backward()
    y = hidden.clone().requires_grad_(True)
    naive_token_logprobs(y, weight, targets, temperature=temperature, top_k=50).sum().backward()
    assert close(x.grad, y.grad)


@pytest.mark.parametrize("kept", [True, False])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_a_bfloat16_forward_rounds_its_inputs_not_its_logits(temperature, kept, monkeypatch):
    """`forward_dtype=bfloat16` (`trainer.autocast_head`): the log-probs are float32's for the
    inputs rounded to bfloat16, to within 0.02 (the shifted product rounds each logit minus its
    row's largest); bfloat16 logits rounded whole are ~0.1 off here (top logits of 40). The
    entropies follow, and the gradients keep the bfloat16 backward's bound, whether the backward
    takes the forward's exp (kept in bfloat16) or, past `KEEP_BYTES`, recomputes it shifted by the
    forward's row maxima, themselves bfloat16 products."""
    from rollflow.logprobs import _NarrowHead

    if not kept:
        monkeypatch.setattr(_NarrowHead, "KEEP_BYTES", 0)
    made = []
    real_softmax = _NarrowHead.softmax
    monkeypatch.setattr(_NarrowHead, "softmax", lambda *a: made.append(1) or real_softmax(*a))
    n, h, v = 64, 64, 4096
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(n, h, generator=g)
    weight = torch.randn(v, h, generator=g) * 0.7
    hidden = hidden * (40 * temperature / (hidden @ weight.t()).amax(-1, keepdim=True))
    targets = torch.multinomial(torch.softmax(hidden @ weight.t() / temperature, -1), 1, generator=g)[:, 0]
    upstream = torch.randn(n, generator=g)
    rounded = ((hidden / temperature).bfloat16().float() * temperature, weight.bfloat16().float())
    results = []
    for dtype, (x0, w0) in ((torch.bfloat16, (hidden, weight)), (None, rounded)):
        x, w = x0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
        lp, entropy = token_logprobs(
            x, w, targets, temperature=temperature, chunk=16, backward_dtype=dtype, forward_dtype=dtype
        )
        (lp * upstream).sum().backward()
        results.append((lp.detach(), entropy, x.grad, w.grad))
    (lp16, ent16, gx16, gw16), (lp_want, ent_want, gx_want, gw_want) = results
    assert bool(made) is not kept  # the backward recomputed its softmax only when nothing was kept
    assert (lp16 - lp_want).abs().max().item() <= 0.02
    whole = (hidden / temperature).bfloat16() @ weight.bfloat16().t()  # the logits rounded whole
    assert (torch.log_softmax(whole.float(), -1).gather(-1, targets[:, None])[:, 0] - lp_want).abs().max() > 0.05
    assert (ent16 - ent_want).abs().max().item() <= 0.02
    for name, got, want in (("hidden", gx16, gx_want), ("weight", gw16, gw_want)):
        error = float((got - want).norm() / want.norm())
        assert error <= 0.008, f"{name} gradient off by {error:.3g} of its norm"
    # A truncated distribution keeps the float32 forward, bit for bit.
    exact, _ = token_logprobs(hidden, weight, targets, temperature=temperature, top_k=50)
    narrow, _ = token_logprobs(hidden, weight, targets, temperature=temperature, top_k=50, forward_dtype=torch.bfloat16)
    assert torch.equal(narrow, exact)


@pytest.mark.parametrize("targets_are", ["each row's top", "random"])
def test_a_bfloat16_forwards_first_guess_of_the_top_is_corrected_where_it_is_low(targets_are):
    """The narrow forward guesses each row's top logit from the chunk's own targets; where a target
    is the top the guess is right, where none is close (random targets) the row's z exceeds
    `SLACK` and the row is computed again. Either way the log-probs are float32's for the rounded
    inputs within 0.02 plus bfloat16's rounding of the target's own z (2^-8 of its log-prob: random
    targets here lie 15-40 below the top), and the shift it reports is what it subtracted (z's
    largest entry <= SLACK)."""
    from rollflow.logprobs import _Buffers, _NarrowHead

    n, h, v = 48, 64, 4096
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(n, h, generator=g)
    weight = torch.randn(v, h, generator=g) * 0.7
    hidden = hidden * (30 / (hidden @ weight.t()).amax(-1, keepdim=True))
    logits = hidden @ weight.t()
    targets = logits.argmax(-1) if targets_are == "each row's top" else torch.randint(0, v, (n,), generator=g)
    rounded = (hidden.bfloat16().float(), weight.bfloat16().float())
    want = naive_token_logprobs(*rounded, targets)
    got, _ = token_logprobs(hidden, weight, targets, chunk=16, forward_dtype=torch.bfloat16)
    assert ((got - want).abs() <= 0.02 + want.abs() * 2**-8).all()
    z, top = _NarrowHead(weight, torch.bfloat16).shifted(hidden, None, 1.0, _Buffers(n, v, hidden.device), "z", targets)
    assert z.amax(-1).max().item() <= _NarrowHead.SLACK
    assert (z + top - rounded[0] @ rounded[1].t()).abs().max().item() <= 0.25  # z + shift = the logits
    # The shift is the top, guessed or redone.
    guess_right = (top.squeeze(-1) - logits.amax(-1)).abs() <= 0.25
    assert guess_right.all()


def test_a_bfloat16_backward_after_an_in_place_update_uses_the_updated_weight():
    """The backward's bfloat16 copy of the head is made once per weight version: the micro-batches
    of one step share it; an optimizer's in-place step, or another tensor, makes a new one."""
    from rollflow.logprobs import _NarrowHead

    hidden, weight, targets = _inputs(32, 32, 512, seed=4)

    def hidden_grad(w: torch.Tensor) -> torch.Tensor:
        x = hidden.detach().clone().requires_grad_(True)
        lp, _ = token_logprobs(x, w, targets, chunk=8, backward_dtype=torch.bfloat16)
        lp.sum().backward()
        return x.grad

    w = weight.detach().clone().requires_grad_(True)
    first = hidden_grad(w)
    copy = _NarrowHead._last
    assert torch.equal(hidden_grad(w), first) and _NarrowHead._last is copy
    with torch.no_grad():
        w.mul_(-1.5)  # as an optimizer's step: in place, the same tensor
    after = hidden_grad(w)
    assert _NarrowHead._last is not copy
    assert torch.equal(after, hidden_grad(w.detach().clone().requires_grad_(True)))
    assert not close(after, first)


def test_entropy_is_the_sampling_distributions():
    hidden, weight, targets = _inputs(9, 8, 30)
    for settings in ({}, {"temperature": 0.6}, {"top_k": 4}):
        _, entropy = token_logprobs(hidden, weight, targets, chunk=4, **settings)
        logits = (hidden @ weight.t()).detach() / settings.get("temperature", 1.0)
        keep = support_mask(logits, settings.get("top_k", 0), 1.0)
        if keep is not None:
            logits = logits.masked_fill(~keep, float("-inf"))
        p = torch.softmax(logits, -1)
        want = -(p * p.log().nan_to_num(neginf=0.0)).sum(-1)
        assert torch.allclose(entropy, want, atol=1e-5 * want.abs().max().item()), settings


def test_support_mask_matches_the_top_k_then_top_p_rule():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert support_mask(logits, 0, 1.0) is None
    assert support_mask(logits, 2, 1.0).tolist() == [[True, True, False, False]]
    # Ascending cumulative mass 0.05, 0.20, 0.50, 1.0: with p = 0.8 the tail of mass <= 0.2 goes.
    assert support_mask(logits, 0, 0.8).tolist() == [[True, True, False, False]]
    assert support_mask(logits, 0, 0.81).tolist() == [[True, True, True, False]]
    # Top-p acts on the top-k-renormalised distribution (0.526, 0.316, 0.158): 0.158 <= 0.19 goes.
    assert support_mask(logits, 3, 0.81).tolist() == [[True, True, False, False]]
    assert support_mask(logits, 3, 0.85).tolist() == [[True, True, True, False]]
    assert support_mask(logits, 0, 0.01).tolist() == [[True, False, False, False]]


def _on_policy():
    logprobs = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -1.5, -2.5]], requires_grad=True)
    behaviour = logprobs.detach().clone()
    advantages = torch.tensor([1.0, -1.0])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    return logprobs, behaviour, advantages, mask


def per_token(advantages, like):
    """A sequence's advantage on each of its tokens, (B,) -> (B, T) like `like`."""
    return advantages[:, None].expand_as(like)


@pytest.mark.parametrize(
    ("normalization", "denominator", "loss_value", "grad"),
    [
        ("token_mean", None, 0.2, [[-0.2, -0.2, 0.0], [0.2, 0.2, 0.2]]),
        ("grpo", None, 0.0, [[-0.25, -0.25, 0.0], [1 / 6, 1 / 6, 1 / 6]]),
        ("dr_grpo", 6.0, 1 / 6, [[-1 / 6, -1 / 6, 0.0], [1 / 6, 1 / 6, 1 / 6]]),
    ],
)
def test_normalizations_by_hand(normalization, denominator, loss_value, grad):
    logprobs, behaviour, advantages, mask = _on_policy()
    loss, metrics = policy_loss(
        logprobs, behaviour, per_token(advantages, logprobs), mask, LossSpec(normalization=normalization),
        divisor=denominator,
    )
    loss.backward()
    assert loss.item() == pytest.approx(loss_value, abs=1e-6)
    assert torch.allclose(logprobs.grad, torch.tensor(grad), atol=1e-6)
    assert metrics["ratio_mean"].item() == pytest.approx(1.0)
    assert metrics["mismatch_kl"].item() == pytest.approx(0.0, abs=1e-7)


def test_asymmetric_clipping_stops_the_gradient_only_where_it_should():
    proximal = torch.zeros(1, 4)
    # Ratios 1.5, 0.5, 1.1, 0.7 against the proximal policy; advantages +1, +1, -1, -1.
    logprobs = torch.log(torch.tensor([[1.5, 0.5, 1.1, 0.7]])).requires_grad_(True)
    token_adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    loss, metrics = policy_loss(
        logprobs, proximal, token_adv, torch.ones(1, 4), LossSpec(eps_low=0.2, eps_high=0.28, is_mode="none"),
        proximal_logprobs=proximal,
    )
    loss.backward()
    g = logprobs.grad[0]
    assert g[0] == 0.0  # 1.5 > 1.28 with A > 0: clipped
    assert g[1] == pytest.approx(-0.5 / 4)  # 0.5 with A > 0: unclipped (pessimistic side)
    assert g[2] == pytest.approx(1.1 / 4)  # 1.1 with A < 0: inside the range
    assert g[3] == 0.0  # 0.7 < 0.8 with A < 0: clipped
    assert metrics["clip_frac"].item() == pytest.approx(0.5)


def test_token_tis_caps_and_mis_masks():
    behaviour = torch.log(torch.tensor([[1.0, 1.0, 1.0]]))
    proximal = torch.log(torch.tensor([[3.0, 0.25, 1.2]]))
    mask = torch.ones(1, 3)
    w, kept = importance_weights(proximal, behaviour, mask, mode="tis", cap=2.0)
    assert w.tolist()[0] == pytest.approx([2.0, 0.25, 1.2])
    assert kept.tolist() == [[1.0, 1.0, 1.0]]
    w, kept = importance_weights(proximal, behaviour, mask, mode="mis", low=0.5, high=2.0)
    assert kept.tolist() == [[0.0, 0.0, 1.0]]
    assert w[0, 2].item() == pytest.approx(1.2)


def test_sequence_is_uses_the_mean_log_ratio_not_the_sum():
    length = 200
    behaviour = torch.zeros(1, length)
    proximal = torch.full((1, length), 0.1)  # every token's ratio e^0.1; the sum would be e^20
    w, kept = importance_weights(proximal, behaviour, torch.ones(1, length), mode="seq_tis", cap=2.0)
    assert w[0, 0].item() == pytest.approx(math.exp(0.1), rel=1e-5)
    assert torch.allclose(w, w[0, 0].expand_as(w))
    _, kept = importance_weights(proximal * 10, behaviour, torch.ones(1, length), mode="seq_mis", high=2.0)
    assert kept.sum() == 0  # mean log-ratio 1.0 -> e > 2: the whole sequence is dropped


def test_is_weights_scale_the_gradient_and_masked_tokens_count():
    logprobs = torch.zeros(1, 2, requires_grad=True)
    behaviour = torch.log(torch.tensor([[0.5, 4.0]]))  # ratios 2 and 0.25
    loss, metrics = policy_loss(logprobs, behaviour, torch.ones(1, 2), torch.ones(1, 2),
                                LossSpec(is_mode="mis", is_low=0.5, is_high=2.0))
    loss.backward()
    assert logprobs.grad.tolist() == [[pytest.approx(-2.0 / 2), 0.0]]
    assert metrics["is_masked_frac"].item() == pytest.approx(0.5)
    assert metrics["ratio_max"].item() == pytest.approx(2.0) and metrics["ratio_min"].item() == pytest.approx(0.25)


def test_k3_kl_to_reference():
    logprobs, behaviour, advantages, mask = _on_policy()
    adv = per_token(advantages, logprobs)
    _, metrics = policy_loss(logprobs, behaviour, adv, mask, LossSpec(kl_coef=0.1), ref_logprobs=logprobs.detach())
    assert metrics["kl_ref"].item() == pytest.approx(0.0)
    ref = logprobs.detach() + 0.5
    loss_kl, metrics = policy_loss(logprobs, behaviour, adv, mask, LossSpec(kl_coef=0.1), ref_logprobs=ref)
    k3 = math.exp(0.5) - 0.5 - 1
    assert metrics["kl_ref"].item() == pytest.approx(k3, rel=1e-6)
    loss_plain, _ = policy_loss(logprobs, behaviour, adv, mask)
    assert (loss_kl - loss_plain).item() == pytest.approx(0.1 * k3, rel=1e-5)


def test_kl_to_a_reference_with_truncated_support_stays_finite():
    """Under top-k / top-p sampling the reference's log-prob of a token can be -inf: outside its
    support. Such tokens, and masked ones (environment tokens), must not reach the KL arithmetic:
    the loss and its gradient stay finite, and the KL is the k3 mean over the tokens where the
    reference defines it."""
    logprobs = torch.tensor([[-1.0, -2.0, -0.5, -1.5]], requires_grad=True)
    behaviour = logprobs.detach().clone()
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0]])  # token 2: an environment token
    inf = float("-inf")
    ref = torch.tensor([[-1.5, inf, inf, -1.0]])  # token 1 outside the reference's support
    loss, metrics = policy_loss(logprobs, behaviour, torch.ones(1, 4), mask, LossSpec(kl_coef=0.1), ref_logprobs=ref)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logprobs.grad).all()
    k3 = [math.exp(d) - d - 1.0 for d in (-0.5, 0.5)]  # tokens 0 and 3
    assert metrics["kl_ref"].item() == pytest.approx(sum(k3) / 2, rel=1e-5)
    plain, _ = policy_loss(logprobs.detach(), behaviour, torch.ones(1, 4), mask)
    assert (loss - plain).item() == pytest.approx(0.1 * sum(k3) / 3, rel=1e-5)  # divided by the 3 loss tokens
    assert logprobs.grad[0, 2].item() == 0.0 and logprobs.grad[0, 1].item() == pytest.approx(-1.0 / 3, rel=1e-5)


def _three_tokens(old: list[float], advantage: float, objective: str):
    """A hand-checkable case: one sequence of 3 tokens whose current log-probs are 0 (so r_t =
    exp(-old_t)), behaviour = old (no importance correction), token-mean over 3 tokens."""
    logprobs = torch.zeros(1, 3, dtype=torch.float64, requires_grad=True)
    old_t = torch.tensor([old], dtype=torch.float64)
    loss, metrics = policy_loss(
        logprobs, old_t, torch.full((1, 3), advantage, dtype=torch.float64), torch.ones(1, 3, dtype=torch.float64),
        LossSpec(eps_low=0.2, eps_high=0.28, is_mode="none", objective=objective), proximal_logprobs=old_t,
    )
    loss.backward()
    return loss.item(), logprobs.grad[0].tolist(), metrics


def test_ppo_clip_with_a_reference_clips_tokens_that_moved_too_far():
    r = [1.5, 1.1, 0.7]  # above 1 + eps_high, inside, below 1 - eps_low
    loss, grad, metrics = _three_tokens([-math.log(x) for x in r], 1.0, "ppo_clip")
    # A > 0: min(r A, clip(r) A) is clip for the first token (no gradient), r for the others.
    assert loss == pytest.approx(-(1.28 + 1.1 + 0.7) / 3)
    assert grad == pytest.approx([0.0, -1.1 / 3, -0.7 / 3])
    assert metrics["clip_frac"].item() == pytest.approx(1 / 3)


def test_gspo_takes_one_ratio_per_sequence_the_geometric_mean_clipped_as_a_whole():
    r = [1.2, 1.05, 0.9]
    s = (1.2 * 1.05 * 0.9) ** (1 / 3)  # ≈ 1.046: inside [0.8, 1.28]
    loss, grad, _ = _three_tokens([-math.log(x) for x in r], 2.0, "gspo")
    assert loss == pytest.approx(-s * 2.0)  # the same value on each of the 3 tokens, token mean
    # loss = -s A and ds/d logprob_t = s / 3: every token moves the sequence's ratio equally.
    assert grad == pytest.approx([-2.0 * s / 3] * 3)
    big = [1.9, 1.8, 1.7]  # geometric mean ≈ 1.80 > 1.28 with A > 0: clipped, no gradient
    loss, grad, _ = _three_tokens([-math.log(x) for x in big], 1.0, "gspo")
    assert loss == pytest.approx(-1.28) and grad == pytest.approx([0.0] * 3)


def test_cispo_keeps_every_token_with_a_clipped_detached_weight():
    r = [1.5, 1.1, 0.7]
    loss, grad, metrics = _three_tokens([-math.log(x) for x in r], 1.0, "cispo")
    # loss = -(1/3) Σ sg(clip(r_t)) A log π_t, and log π_t = 0 here.
    assert loss == pytest.approx(0.0)
    assert grad == pytest.approx([-1.28 / 3, -1.1 / 3, -0.8 / 3])  # the clipped token still has a gradient
    assert metrics["clip_frac"].item() == pytest.approx(2 / 3)


@pytest.mark.parametrize(
    ("estimator", "value", "slope"),
    # delta = log π_ref - log π = -0.5 (π above the reference); d/d log π of each estimate.
    [("k1", 0.5, 1.0), ("k2", 0.125, 0.5), ("k3", math.exp(-0.5) + 0.5 - 1.0, 1.0 - math.exp(-0.5))],
)
def test_kl_estimators_have_their_closed_form_and_stay_finite_where_undefined(estimator, value, slope):
    logprobs = torch.tensor([[-1.0, -1.0, -1.0]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-1.5, float("-inf"), -1.5]], dtype=torch.float64)  # the middle token: outside its support
    mask = torch.tensor([[1.0, 1.0, 0.0]], dtype=torch.float64)  # the last token is not in the loss
    loss, metrics = policy_loss(
        logprobs, logprobs.detach(), torch.zeros(1, 3, dtype=torch.float64), mask,
        LossSpec(is_mode="none", kl_coef=1.0, kl_estimator=estimator, normalization="token_mean"), ref_logprobs=ref,
    )
    loss.backward()
    # Advantages are 0, so the loss is the KL term of the one defined loss token over 2 loss tokens.
    assert loss.item() == pytest.approx(value / 2) and metrics["kl_ref"].item() == pytest.approx(value)
    assert logprobs.grad[0].tolist() == pytest.approx([slope / 2, 0.0, 0.0])


def test_the_fused_head_is_chosen_only_on_cuda_with_liger_and_otherwise_the_chunked_head_serves(caplog, monkeypatch):
    """liger-kernel's fused kernel plugs in behind the same loss on CUDA with the package
    installed; elsewhere, and for truncated sampling it does not know, the chunked head runs. One
    log line says which."""
    import importlib.util
    import logging

    from rollflow.trainer import heads

    with caplog.at_level(logging.INFO, "rollflow.trainer.heads"):
        assert heads.choose_head(True, torch.device("cpu")) == (
            "chunked", "liger-kernel's fused kernel needs CUDA (the trainer is on cpu)"
        )
    assert [r.getMessage() for r in caplog.records] == [
        "loss head: chunked (liger-kernel's fused kernel needs CUDA (the trainer is on cpu))"
    ]
    assert heads.choose_head(False, torch.device("cuda"))[0] == "chunked"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert heads.choose_head(True, torch.device("cuda")) == (
        "chunked", "liger-kernel is not installed (pip install 'rollflow[gpu]')"
    )
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())
    assert heads.choose_head(True, torch.device("cuda"))[0] == "fused"

    torch.manual_seed(0)
    hidden, weight = torch.randn(6, 8), torch.randn(20, 8)
    targets = torch.randint(0, 20, (6,))
    called = []

    def fake_fused(hidden, weight, targets, temperature):
        called.append(temperature)
        return naive_token_logprobs(hidden, weight, targets, temperature=temperature)

    monkeypatch.setattr(heads, "fused_logprobs", fake_fused)
    settings = {"temperature": 0.7, "top_k": 5, "top_p": 1.0, "chunk": 4}
    truncated, _ = heads.head_logprobs("fused", hidden, weight, targets, **settings)
    want = naive_token_logprobs(hidden, weight, targets, temperature=0.7, top_k=5)
    assert called == [] and torch.allclose(truncated, want, atol=1e-5 * want.abs().max().item())
    plain, entropy = heads.head_logprobs("fused", hidden, weight, targets, **(settings | {"top_k": 0}))
    assert called == [0.7] and entropy.abs().sum() == 0  # the fused kernel measures no entropy
    chunked, _ = heads.head_logprobs("chunked", hidden, weight, targets, **(settings | {"top_k": 0}))
    assert torch.allclose(plain, chunked, atol=1e-5 * chunked.abs().max().item())


def test_a_fused_kernel_whose_backward_ignores_per_token_weights_fails_its_check(monkeypatch):
    """A policy loss weighs each token's log-prob by its own advantage; a kernel whose backward
    takes those weights as one scale would train on wrong gradients. The trainer checks the
    fused kernel against the chunked head before using it."""
    from rollflow.trainer import heads

    weight = torch.randn(50, 16) * 0.3

    class OneScale(torch.autograd.Function):
        @staticmethod
        def forward(ctx, hidden, weight, targets):
            ctx.save_for_backward(hidden, weight, targets)
            return naive_token_logprobs(hidden, weight, targets)

        @staticmethod
        def backward(ctx, grad):
            hidden, weight, targets = ctx.saved_tensors
            with torch.enable_grad():
                h = hidden.detach().requires_grad_(True)
                naive_token_logprobs(h, weight, targets).sum().backward()
            return h.grad * grad.mean(), None, None  # every token scaled alike: wrong

    monkeypatch.setattr(heads, "fused_logprobs", lambda h, w, t, temperature: naive_token_logprobs(h, w, t))
    assert heads.check_fused(weight) is None  # a kernel that honours per-token weights passes
    monkeypatch.setattr(heads, "fused_logprobs", lambda h, w, t, temperature: OneScale.apply(h, w, t))
    problem = heads.check_fused(weight)
    assert problem is not None and problem.startswith("per-token gradient off the chunked head")
