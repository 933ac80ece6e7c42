"""The trainer on the tiny model, one rank: on-policy ratios, micro-batch invariance, LoRA, state."""

from __future__ import annotations

import io
import math

import msgspec
import pytest
import torch

from rollflow.config import LoRAConfig, LossConfig, TrainerConfig
from rollflow.models import resolve_model, tiny_model_path
from rollflow.records import TrainSample
from rollflow.trainer import Trainer, plan_micro_batches, plan_shards
from rollflow.trainer.batches import pad


def params(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.full_weights()}


def test_step_on_policy_has_unit_ratios_and_changes_weights(make_batch):
    trainer = Trainer(tiny_model_path(0), TrainerConfig(lr=1e-3))
    batch = make_batch(trainer, temperature=0.7, top_k=20)
    before = params(trainer)
    # Untruncated scoring for the objective check below (after the step a sampled token may
    # leave the top-k support).
    plain = [msgspec.structs.replace(s, top_k=0) for s in batch.samples]
    old = trainer.score(plain)
    metrics = trainer.step(batch)
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert metrics["ratio_min"] == pytest.approx(1.0, abs=1e-5) and metrics["ratio_max"] == pytest.approx(1.0, abs=1e-5)
    assert metrics["mismatch_kl"] == pytest.approx(0.0, abs=1e-6)
    assert metrics["tokens"] == sum(s.num_completion for s in batch.samples)
    assert metrics["grad_norm"] > 0 and metrics["entropy"] > 0
    after = params(trainer)
    assert any(not torch.equal(before[k], after[k]) for k in before)
    # The step increased the objective: advantage-weighted log-likelihood of the batch.
    new = trainer.score(plain)
    objective = sum(s.advantage * (sum(n) - sum(o)) for n, o, s in zip(new, old, plain, strict=True))
    assert objective > 0


def test_micro_batching_does_not_change_the_step(make_batch, close):
    whole = Trainer(tiny_model_path(0), TrainerConfig(lr=1e-3, micro_batch_tokens=10_000))
    split = Trainer(tiny_model_path(0), TrainerConfig(lr=1e-3, micro_batch_tokens=24))
    batch = make_batch(whole)
    assert len(plan_micro_batches(batch.samples, list(range(6)), 24)) > 2
    s1, _, _ = whole.accumulate(batch)
    s2, _, _ = split.accumulate(batch)
    assert s1[0].item() == pytest.approx(s2[0].item(), rel=1e-5, abs=1e-6)  # the loss
    a, b = whole.gradients(), split.gradients()
    assert a.keys() == b.keys() and a
    for k in a:  # sums over micro-batches in another order: compare against each tensor's scale
        close(a[k], b[k], rel=1e-4, name=k)


def test_plans_cover_every_sample_once():
    batch_sizes = [5, 40, 7, 7, 33, 2, 18]
    samples = [TrainSample(input_ids=[1] * n, prompt_len=1, logprobs=[], loss_mask=[], advantage=0.0)
               for n in batch_sizes]
    shards = plan_shards(samples, 3)
    assert sorted(i for s in shards for i in s) == list(range(7))
    loads = [sum(batch_sizes[i] for i in s) for s in shards]
    assert max(loads) - min(loads) <= 40
    micro = plan_micro_batches(samples, list(range(7)), 40)
    assert sorted(i for m in micro for i in m) == list(range(7))
    assert all(len(m) * max(batch_sizes[i] for i in m) <= 40 for m in micro)


def test_lora_trains_only_the_adapter_and_merged_export_matches(make_batch):
    from transformers import AutoModelForCausalLM

    trainer = Trainer(tiny_model_path(0), TrainerConfig(lr=1e-2, lora=LoRAConfig(enabled=True, rank=4)))
    base_before = {k: v.clone() for k, v in trainer.lm.state_dict().items() if "lora_" not in k}
    batch = make_batch(trainer)
    for _ in range(2):
        trainer.step(batch)
    base_after = {k: v for k, v in trainer.lm.state_dict().items() if "lora_" not in k}
    assert all(torch.equal(base_before[k], base_after[k]) for k in base_before)
    adapter = trainer.adapter_weights()
    assert adapter and all("lora_" in k for k in adapter)
    assert any(v.abs().sum() > 0 for k, v in adapter.items() if "lora_B" in k)
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_path(0), dtype=torch.float32).eval()
    plain.load_state_dict(dict(trainer.full_weights()), strict=True)
    ids = torch.tensor([batch.samples[0].input_ids])
    trainer.lm.eval()
    with torch.no_grad():
        want = trainer.lm(input_ids=ids).logits
        got = plain(input_ids=ids).logits
    assert torch.allclose(got, want, atol=1e-4)


def test_kl_to_reference_and_state_dict_round_trip(make_batch):
    cfg = TrainerConfig(lr=1e-3)
    trainer = Trainer(tiny_model_path(0), cfg, LossConfig(kl_coef=0.5))
    batch = make_batch(trainer)
    first = trainer.step(batch)
    assert first["kl_ref"] == pytest.approx(0.0, abs=1e-7)  # the first step starts at the reference
    second = trainer.step(batch)
    assert second["kl_ref"] > 0
    buffer = io.BytesIO()
    torch.save(trainer.state_dict(), buffer)  # as a checkpoint would: no tensors shared
    buffer.seek(0)
    other = Trainer(tiny_model_path(0), cfg, LossConfig(kl_coef=0.5))
    other.load_state_dict(torch.load(buffer, weights_only=False))
    assert other.steps == 2
    m1, m2 = trainer.step(batch), other.step(batch)
    assert m1["loss"] == pytest.approx(m2["loss"], rel=1e-6)
    a, b = params(trainer), params(other)
    assert all(torch.allclose(a[k], b[k], atol=1e-7) for k in a)


def test_a_non_finite_step_is_skipped_and_changes_nothing(make_batch):
    trainer = Trainer(tiny_model_path(0), TrainerConfig(lr=1e-2))
    batch = make_batch(trainer)
    poisoned = msgspec.structs.replace(
        batch, samples=[msgspec.structs.replace(batch.samples[0], advantage=float("nan")), *batch.samples[1:]]
    )
    before = params(trainer)
    lr_before = trainer.scheduler.get_last_lr()
    out = trainer.step(poisoned)
    assert out["skipped"] == 1.0 and trainer.steps == 0
    assert all(torch.equal(before[k], v) for k, v in params(trainer).items())
    assert trainer.scheduler.get_last_lr() == lr_before
    assert all(p.grad is None for p in trainer.module.parameters())  # nothing carried into the next step
    assert trainer.step(batch)["skipped"] == 0.0 and trainer.steps == 1
    assert any(not torch.equal(before[k], v) for k, v in params(trainer).items())


def test_save_and_load_restore_weights_optimizer_and_schedule(tmp_path, make_batch):
    config = TrainerConfig(lr=1e-2, warmup_steps=3)
    a = Trainer(tiny_model_path(0), config)
    a.step(make_batch(a, seed=1))
    rest = a.save(tmp_path / "trainer")
    b = Trainer(tiny_model_path(0), config)
    b.load(tmp_path / "trainer", msgspec.msgpack.decode(msgspec.msgpack.encode(rest)))
    assert b.steps == 1 and b.scheduler.get_last_lr() == a.scheduler.get_last_lr()
    batch = make_batch(a, seed=2)
    a.step(batch)
    b.step(batch)  # identical only if AdamW's moments came back too
    assert all(torch.equal(x, y) for x, y in zip(params(a).values(), params(b).values(), strict=True))


def test_kl_penalty_with_top_k_and_masked_tokens_stays_finite(make_batch):
    """`loss.kl_coef` with top-k sampling and an environment token outside the top-k support: the
    reference's log-prob there is -inf, and the step must still be finite (not skipped)."""
    trainer = Trainer(tiny_model_path(0), TrainerConfig(lr=1e-3), LossConfig(kl_coef=0.01))
    batch = make_batch(trainer, top_k=5)
    first = batch.samples[0]
    ids = torch.tensor([first.input_ids])
    with torch.no_grad():
        logits = trainer.lm(input_ids=ids).logits[0]
    # An environment token (mask 0) the model would never sample under top-k 5: its least likely one.
    position = first.prompt_len + 1
    token = int(logits[position - 1].argmin())
    input_ids = list(first.input_ids)
    input_ids[position] = token
    mask = list(first.loss_mask)
    mask[1] = 0
    behaviour = list(first.logprobs)
    behaviour[1] = 0.0
    env_sample = msgspec.structs.replace(first, input_ids=input_ids, loss_mask=mask, logprobs=behaviour)
    poisoned = msgspec.structs.replace(batch, samples=[env_sample, *batch.samples[1:]])
    metrics = trainer.step(poisoned)
    assert metrics["skipped"] == 0.0 and math.isfinite(metrics["loss"]) and math.isfinite(metrics["kl_ref"])
    assert math.isfinite(metrics["grad_norm"]) and trainer.steps == 1


def test_one_update_per_batch_has_no_clipping_and_several_updates_clip(make_batch):
    """With the defaults the PPO ratio is 1 (nothing to clip); with 4 mini-batches a large step
    moves the policy away from its pre-step log-probs and the clip range takes effect."""
    one = Trainer(tiny_model_path(0), TrainerConfig(lr=0.05))
    batch = make_batch(one, n=8)
    first = one.step(batch)
    assert first["clip_frac"] == 0.0
    several = Trainer(tiny_model_path(0), TrainerConfig(lr=0.05, mini_batches=4, epochs=2))
    metrics = several.step(batch)
    assert metrics["clip_frac"] > 0 and several.steps == 1
    assert metrics["tokens"] == first["tokens"] == sum(s.num_completion for s in batch.samples)


def test_several_updates_change_the_weights_once_per_update_and_cispo_gspo_train(make_batch):
    for objective in ("cispo", "gspo"):
        trainer = Trainer(tiny_model_path(0), TrainerConfig(lr=1e-3, mini_batches=2), LossConfig(objective=objective))
        batch = make_batch(trainer)
        plain = list(batch.samples)
        old = trainer.score(plain)
        metrics = trainer.step(batch)
        assert math.isfinite(metrics["loss"]) and metrics["skipped"] == 0.0
        new = trainer.score(plain)
        gain = sum(s.advantage * (sum(n) - sum(o)) for n, o, s in zip(new, old, plain, strict=True))
        assert gain > 0, objective  # the advantage-weighted log-likelihood went up


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize(
    "model", ["tiny", pytest.param("smollm2-135m-instruct", marks=pytest.mark.integration)], ids=["tiny", "smollm2"]
)
def test_every_layout_gives_the_padded_log_probs_and_gradients(make_batch, close, model, lora):
    """Packed rows and shared prompts change the work, not the result (float32)."""
    config = TrainerConfig(lr=1e-3, micro_batch_tokens=48, lora=LoRAConfig(enabled=lora, rank=4))
    trainers = {
        layout: Trainer(resolve_model(model), msgspec.structs.replace(config, layout=layout))
        for layout in ("padded", "packed", "shared_prompt")
    }
    batch = make_batch(trainers["padded"], n=12, group=4)
    assert len({tuple(s.input_ids[: s.prompt_len]) for s in batch.samples}) == 3
    # Several micro-batches in every layout, and a group split across two of them.
    for layout in trainers:
        assert len(plan_micro_batches(batch.samples, list(range(12)), 48, layout)) > 1
    want_lp = trainers["padded"].score(batch.samples)
    want_loss = trainers["padded"].accumulate(batch)[0][0].item()
    want = trainers["padded"].gradients()
    for layout in ("packed", "shared_prompt"):
        got_lp = trainers[layout].score(batch.samples)
        for g, w in zip(got_lp, want_lp, strict=True):
            close(torch.tensor(g), torch.tensor(w), rel=1e-5, name=f"{layout} log-probs")
        # The loss is a token mean of advantage-weighted ratios near ±1 that mostly cancel: compare
        # on the scale of its terms.
        assert trainers[layout].accumulate(batch)[0][0].item() == pytest.approx(want_loss, abs=1e-5)
        got = trainers[layout].gradients()
        assert got.keys() == want.keys() and got
        # Float32 through 30 layers: on SmolLM2 the padded path itself, with other micro-batches,
        # moves single elements by ~5e-5 of their tensor's scale and the whole gradient by ~5e-6
        # of its norm; the tiny model stays within 1e-5 element-wise.
        for k in want:
            close(got[k], want[k], rel=1e-5 if model == "tiny" else 3e-4, name=f"{layout} {k}")
        diff = sum(float((got[k].double() - want[k].double()).square().sum()) for k in want) ** 0.5
        norm = sum(float(want[k].double().square().sum()) for k in want) ** 0.5
        assert diff <= 2e-5 * norm, f"{layout}: |gradient difference| = {diff / norm:.3g} of its norm"


def test_packed_plans_fill_the_budget_and_share_each_prompt_once():
    prompt = [7] * 10
    def sample(prompt: list[int], n: int) -> TrainSample:
        return TrainSample(
            input_ids=prompt + [1] * n, prompt_len=len(prompt), logprobs=[0.0] * n, loss_mask=[1] * n, advantage=0.0
        )

    samples = [sample(prompt, n) for n in (5, 30, 12, 3)] + [sample([8] * 6, 4)]
    everything = list(range(5))
    padded = plan_micro_batches(samples, everything, 64, "padded")
    packed = plan_micro_batches(samples, everything, 64, "packed")
    shared = plan_micro_batches(samples, everything, 64, "shared_prompt")
    for plan in (padded, packed, shared):
        assert sorted(i for m in plan for i in m) == everything
    assert all(sum(len(samples[i].input_ids) for i in m) <= 64 for m in packed if len(m) > 1)
    assert len(packed) < len(padded)
    # 10 + 5 + 30 + 12 + 3 = 60 tokens for the first group's prompt once: one micro-batch, with
    # the second group's 10 tokens in a second.
    assert sorted(map(sorted, shared)) == [[0, 1, 2, 3], [4]]
    t = pad([samples[i] for i in (0, 1, 2, 3)], torch.device("cpu"), "shared_prompt")
    assert t["tokens"] == 60
    # The prompt once, then each completion attending to it (prefix 0:10) and causally to itself.
    assert t["segments"] == [(0, 10, 0, 0), (10, 15, 0, 10), (15, 45, 0, 10), (45, 57, 0, 10), (57, 60, 0, 10)]
    assert t["positions"][0, 15].item() == 10  # the second completion's positions follow the prompt
    assert t["gather"][5].item() == 9  # its first token is predicted by the prompt's last position


@pytest.mark.parametrize("layout", ["padded", "packed", "shared_prompt"])
def test_model_tokens_counts_what_the_layout_lays_out(layout):
    """The count the metrics and the simulator use equals the tokens of the tensors a step builds."""
    import random

    from rollflow.trainer.batches import model_tokens, pad

    rng = random.Random(7)
    samples = []
    for group in range(5):
        prompt = [rng.randrange(3, 90) for _ in range(rng.randint(5, 40))]
        for _ in range(4):
            n = rng.randint(1, 60)
            samples.append(TrainSample(input_ids=prompt + [group + 3] * n, prompt_len=len(prompt),
                                       logprobs=[0.0] * n, loss_mask=[1] * n, advantage=1.0))
    for budget in (64, 200, 4096):
        plan = plan_micro_batches(samples, list(range(len(samples))), budget, layout)
        laid_out = sum(pad([samples[i] for i in micro], torch.device("cpu"), layout)["tokens"] for micro in plan)
        assert model_tokens(samples, budget, layout) == laid_out


@pytest.mark.parametrize("layout", ["padded", "shared_prompt"])
def test_bfloat16_autocast_computes_the_body_in_bfloat16_and_keeps_float32_weights(make_batch, layout):
    """`trainer.autocast = "bfloat16"`: the body's products in bfloat16 (its log-probs differ from
    float32's by bfloat16's rounding, not by more), the weights and their updates in float32."""
    plain = Trainer(tiny_model_path(0), TrainerConfig(lr=1e-3, layout=layout))
    mixed = Trainer(tiny_model_path(0), TrainerConfig(lr=1e-3, layout=layout, autocast="bfloat16"))
    batch = make_batch(plain, temperature=1.0)
    want = torch.tensor([x for lp in plain.score(batch.samples) for x in lp])
    got = torch.tensor([x for lp in mixed.score(batch.samples) for x in lp])
    gap = (got - want).abs().max().item()
    assert 0 < gap <= 0.1 * want.abs().max().item(), gap  # bfloat16 keeps about 3 significant digits
    before = params(mixed)
    metrics = mixed.step(batch)
    assert math.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
    after = params(mixed)
    assert all(t.dtype == torch.float32 for t in after.values())
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_a_bfloat16_head_scores_as_the_float32_head_up_to_bfloat16s_rounding(make_batch):
    """`trainer.autocast_head`: the head's forward is a bfloat16 product too (the log-probs move,
    by less than bfloat16 logits rounded whole would move them), and a step still trains."""
    mixed = Trainer(tiny_model_path(0), TrainerConfig(lr=1e-3, autocast="bfloat16"))
    narrow = Trainer(tiny_model_path(0), TrainerConfig(lr=1e-3, autocast="bfloat16", autocast_head=True))
    batch = make_batch(mixed, temperature=1.0)
    want = torch.tensor([x for lp in mixed.score(batch.samples) for x in lp])
    got = torch.tensor([x for lp in narrow.score(batch.samples) for x in lp])
    gap = (got - want).abs().max().item()
    assert 0 < gap <= 0.02 * max(1.0, want.abs().max().item()), gap
    before = params(narrow)
    metrics = narrow.step(batch)
    assert math.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
    assert any(not torch.equal(before[k], v) for k, v in params(narrow).items())
