"""The TRL side of bench/vs_trl.py: TRL's `GRPOTrainer` on the benchmark's task, timed per step.

Runs in TRL's own environment (`bin/dev bench-env trl`), never rollflow's, and imports nothing
of rollflow: it takes the model folder and the prompts from vs_trl.py and prints one JSON line
with the wall time at the end of every optimizer step, so both sides measure the same thing
(a step's generation, scoring and training, and whatever else the trainer does per step).

    python bench/trl_grpo.py --model DIR --prompts FILE --steps N --tokens T
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time


def digits(completions, **kwargs):
    """The benchmark's reward (rollflow's `digits`): the fraction of a completion's characters that are digits."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [sum(ch.isdigit() for ch in t) / len(t) if t else 0.0 for t in texts]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompts", required=True, help="a JSON list of user messages, one per prompt")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--tokens", type=int, required=True, help="completion tokens of every sample")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--bf16", action="store_true", help="bfloat16 mixed precision (GRPOConfig's bf16)")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(1)  # one torch thread per process, as on the rollflow side
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    with open(args.prompts) as f:
        questions = json.load(f)
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": q}]} for q in questions])
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)

    class Clock(TrainerCallback):
        def __init__(self) -> None:
            self.began = 0.0
            self.ends: list[float] = []
            self.tokens: list[float] = []

        def on_train_begin(self, args, state, control, **kwargs):
            self.began = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.ends.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "completions/mean_length" in logs:
                self.tokens.append(logs["completions/mean_length"] * args.per_device_train_batch_size)

    clock = Clock()
    with tempfile.TemporaryDirectory(prefix="trl-grpo-") as out:
        config = GRPOConfig(
            output_dir=out,
            per_device_train_batch_size=args.groups * args.group_size,
            num_generations=args.group_size,
            steps_per_generation=1,
            max_completion_length=args.tokens,
            generation_kwargs={"min_new_tokens": args.tokens},  # every sample is T tokens, as with ignore_eos
            temperature=1.0,
            beta=0.0,
            learning_rate=args.lr,
            max_steps=args.steps,
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            use_cpu=True,
            bf16=args.bf16,
            seed=0,
            disable_tqdm=True,
            dataloader_num_workers=0,
            log_completions=False,
        )
        trainer = GRPOTrainer(
            model=model, reward_funcs=digits, args=config, train_dataset=dataset, processing_class=tokenizer,
            callbacks=[clock],
        )  # fmt: skip
        trainer.train()
    print(json.dumps({"trl": trl.__version__, "began": clock.began, "ends": clock.ends, "tokens": clock.tokens}))


if __name__ == "__main__":
    main()
