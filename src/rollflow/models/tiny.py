"""A deterministic tiny Llama model with a locally trained tokenizer, built in seconds.

Used by tests, the `tiny` preset and benchmarks: no downloads, same bytes for the same seed.
The tokenizer is a byte-level BPE trained on a fixed built-in corpus (so it is identical for
every seed); only the weights depend on the seed. Two-dimensional weights are drawn from a wide
normal so that greedy outputs differ clearly between seeds, which weight-sync tests rely on.

This module does not train the model; a random tiny model is a test fixture, not a policy.
"""

from __future__ import annotations

from pathlib import Path

from rollflow.models.cache import build_once, cache_root

TINY_BUILD = 2
"""Bumped whenever the recipe below changes, so stale cached folders are not reused."""

HIDDEN_SIZE = 128
NUM_LAYERS = 2
NUM_HEADS = 2  # head_dim 64: a size every vLLM CPU attention kernel supports
NUM_KV_HEADS = 1
INTERMEDIATE_SIZE = 256
VOCAB_SIZE = 1024
MAX_POSITIONS = 2048
WEIGHT_STD = 0.25
"""Std of re-drawn 2-D weights: wide enough that greedy output depends clearly on the seed."""

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>"]


def _corpus() -> list[str]:
    """A fixed corpus: chat-formatted arithmetic and a little English, enough for BPE merges."""
    lines = []
    words = [
        "the",
        "answer",
        "is",
        "what",
        "plus",
        "minus",
        "times",
        "equals",
        "question",
        "please",
        "compute",
        "result",
        "number",
        "tool",
        "call",
        "calculator",
        "think",
        "step",
        "first",
        "then",
        "sum",
        "of",
        "and",
        "a",
        "to",
        "use",
        "reach",
        "target",
        "with",
        "numbers",
        "each",
        "once",
        "make",
        "countdown",
        "solve",
        "correct",
        "wrong",
        "yes",
        "no",
    ]
    for a in range(0, 60):
        for b in range(0, 60, 7):
            lines.append(f"What is {a} + {b}? The answer is {a + b}.")
            lines.append(f"{a} * {b} = {a * b}; {a} - {b} = {a - b}")
    for i in range(len(words)):
        lines.append(" ".join(words[i:] + words[:i]))
    lines.append("<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n5<|im_end|>")
    return lines


def build_tokenizer():  # -> PreTrainedTokenizerFast
    """Train the byte-level BPE tokenizer and wrap it for transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<pad>",
        bos_token=None,
        unk_token=None,
    )
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def build_tiny_model(out_dir: Path, seed: int) -> None:
    """Write a tiny float32 Llama model and its tokenizer into `out_dir`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_tokenizer()
    vocab = len(tokenizer)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=HIDDEN_SIZE,
        intermediate_size=INTERMEDIATE_SIZE,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_KV_HEADS,
        head_dim=HIDDEN_SIZE // NUM_HEADS,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        dtype="float32",
    )
    generator = torch.Generator().manual_seed(seed)
    with torch.device("cpu"):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 2:
                param.copy_(torch.randn(param.shape, generator=generator) * WEIGHT_STD)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


def tiny_model_path(seed: int = 0) -> Path:
    """Path of the tiny model for `seed`, built and cached on first use."""
    target = cache_root() / "models" / f"tiny-llama-b{TINY_BUILD}-seed{seed}"
    return build_once(target, lambda tmp: build_tiny_model(tmp, seed))
