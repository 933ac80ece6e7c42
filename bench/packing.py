"""Trainer layouts: one optimizer step, padded vs packed vs shared prompt, side by side in one run.

The batch is what GRPO produces: groups of 8 samples sharing a 200-token prompt, completion
lengths drawn from a lognormal with mean 300 and sigma 0.8, capped at 1024. Each layout gets
its own trainer (same weights, same token budget per micro-batch) and runs the same step after
a warm-up step; the tokens each layout puts through the model come from its own micro-batch
plan. Prints a table and, last,
`RESULT packing_speedup=X prefix_sharing_speedup=Y padding_waste_padded=Z` (speedups are
padded step time / layout step time; the waste is the padded plan's share of pad tokens).

    bin/dev python bench/packing.py [--model smollm2-135m-instruct|tiny] [--groups 1] [--rounds 2]
"""

from __future__ import annotations

import argparse
import math
import random
import time

import machine

LAYOUTS = ("padded", "packed", "shared_prompt")


def make_batch(groups: int, group_size: int, prompt_len: int, vocab: int, seed: int, mean: float = 300):
    from rollflow.records import TrainBatch, TrainSample

    rng = random.Random(seed)
    sigma = 0.8
    mu = math.log(mean) - sigma**2 / 2  # a lognormal whose mean is `mean`
    samples = []
    for _ in range(groups):
        prompt = [rng.randrange(3, vocab) for _ in range(prompt_len)]
        for i in range(group_size):
            n = max(1, min(1024, round(rng.lognormvariate(mu, sigma))))
            samples.append(
                TrainSample(
                    input_ids=prompt + [rng.randrange(3, vocab) for _ in range(n)],
                    prompt_len=prompt_len,
                    logprobs=[-2.0] * n,
                    loss_mask=[1] * n,
                    advantage=1.0 if i % 2 else -1.0,
                )
            )
    return TrainBatch(step=0, samples=samples, max_tokens=1024)


def model_tokens(trainer, batch) -> int:
    """Tokens the layout's micro-batches put through the model, padding included."""
    import torch

    from rollflow.trainer.batches import pad, plan_micro_batches

    plan = plan_micro_batches(batch.samples, list(range(len(batch.samples))), trainer.config.micro_batch_tokens,
                              trainer.config.layout)
    return sum(pad([batch.samples[i] for i in m], torch.device("cpu"), trainer.config.layout)["tokens"] for m in plan)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--groups", type=int, default=1)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=200)
    parser.add_argument("--budget", type=int, default=4096, help="trainer.micro_batch_tokens")
    parser.add_argument("--rounds", type=int, default=2, help="timed steps per layout (the median is kept)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    import statistics

    import torch

    from rollflow.config import TrainerConfig
    from rollflow.models import resolve_model
    from rollflow.trainer import Trainer

    torch.manual_seed(args.seed)
    path = resolve_model(args.model)
    trainers = {
        layout: Trainer(path, TrainerConfig(lr=1e-6, micro_batch_tokens=args.budget, layout=layout))
        for layout in LAYOUTS
    }
    vocab = trainers["padded"].lm.config.vocab_size
    batch = make_batch(args.groups, args.group_size, args.prompt_len, vocab, args.seed)
    warm = make_batch(1, 2, 16, vocab, args.seed + 1)
    real = sum(len(s.input_ids) for s in batch.samples)
    completions = [s.num_completion for s in batch.samples]
    print(f"model={args.model} samples={len(batch.samples)} prompt={args.prompt_len} tokens "
          f"completions mean={statistics.mean(completions):.0f} max={max(completions)} "
          f"budget={args.budget} threads={torch.get_num_threads()}")
    times: dict[str, list[float]] = {layout: [] for layout in LAYOUTS}
    for trainer in trainers.values():
        trainer.step(warm)
    for _ in range(args.rounds):  # interleaved, so a slow spell of the machine hits every layout
        for layout, trainer in trainers.items():
            began = time.perf_counter()
            trainer.step(batch)
            times[layout].append(time.perf_counter() - began)
    step = {layout: statistics.median(t) for layout, t in times.items()}
    tokens = {layout: model_tokens(trainer, batch) for layout, trainer in trainers.items()}
    print(f"{'layout':<16}{'model tokens':>14}{'pad/shared waste':>18}{'step s':>10}{'speedup':>10}")
    for layout in LAYOUTS:
        waste = 1 - real / tokens[layout] if tokens[layout] >= real else -(real - tokens[layout]) / real
        print(f"{layout:<16}{tokens[layout]:>14}{waste:>18.3f}{step[layout]:>10.2f}"
              f"{step['padded'] / step[layout]:>10.2f}")
    print("(a negative waste is the prompt tokens a shared layout does not compute again)")
    print(machine.describe())
    print(f"RESULT packing_speedup={step['padded'] / step['packed']:.2f} "
          f"prefix_sharing_speedup={step['padded'] / step['shared_prompt']:.2f} "
          f"padding_waste_padded={1 - real / tokens['padded']:.3f}")


if __name__ == "__main__":
    main()
