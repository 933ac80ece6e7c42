"""Model references: built-ins resolve locally, anything else is a clear error."""

from __future__ import annotations

import pytest

from rollflow.errors import ModelNotFoundError
from rollflow.models import chat_encoder, load_tokenizer, resolve_model
from rollflow.records import Message


def test_missing_or_bad_model_paths_are_clear_errors(tmp_path):
    with pytest.raises(ModelNotFoundError, match=r"model.path '.*nowhere': does not exist; expected a local"):
        resolve_model(str(tmp_path / "nowhere"))
    with pytest.raises(ModelNotFoundError, match="has no config.json"):
        resolve_model(str(tmp_path))
    with pytest.raises(ModelNotFoundError, match="tiny:SEED"):
        resolve_model("tiny:x")
    with pytest.raises(ModelNotFoundError, match="never downloads"):
        resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")


def test_tiny_model_is_deterministic_per_seed_and_has_a_chat_template():
    from safetensors.torch import load_file

    a0, a0_again, b = resolve_model("tiny"), resolve_model("tiny:0"), resolve_model("tiny:1")
    assert a0 == a0_again and a0 != b
    wa, wb = load_file(a0 / "model.safetensors"), load_file(b / "model.safetensors")
    assert wa.keys() == wb.keys()
    assert not all((wa[k] == wb[k]).all() for k in wa if wa[k].ndim == 2)
    tokenizer = load_tokenizer(a0)
    ids = chat_encoder(tokenizer)([Message(role="user", content="What is 2 + 3?")])
    text = tokenizer.decode(ids)
    assert text.startswith("<|im_start|>user\nWhat is 2 + 3?<|im_end|>") and text.endswith("<|im_start|>assistant\n")
    assert tokenizer.decode(tokenizer.encode("The answer is 42.")) == "The answer is 42."


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_a_corrupt_weight_file_is_named_when_the_model_is_resolved(tmp_path, damage):
    import shutil

    from rollflow.errors import ModelNotFoundError
    from rollflow.models import tiny_model_path

    folder = tmp_path / "model"
    shutil.copytree(tiny_model_path(0), folder)
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(b"\xff" * 64 if damage == "garbage" else data[: len(data) // 2])
    unreadable = r"model.safetensors is not a readable safetensors file .*truncated or corrupt"
    with pytest.raises(ModelNotFoundError, match=unreadable):
        resolve_model(str(folder))
    assert resolve_model(str(tiny_model_path(0))) == tiny_model_path(0).resolve()


async def test_a_kv_cache_too_small_for_one_sequence_is_refused_in_rollflows_keys():
    from rollflow.config import EngineConfig
    from rollflow.engine.environment import kv_bytes_per_token
    from rollflow.engine.vllm import VLLMEngine
    from rollflow.errors import ConfigError
    from rollflow.models import tiny_model_path

    # The tiny model: 2 layers x 1 KV head x head_dim 64, keys and values, float32.
    assert kv_bytes_per_token(tiny_model_path(0), "float32") == 2 * 2 * 1 * 64 * 4
    small = EngineConfig(kv_cache_bytes=512 * 1024, max_model_len=1024)
    refused = r"engine.kv_cache_bytes: 524288 bytes hold 512 tokens .*max_model_len = 1024"
    with pytest.raises(ConfigError, match=refused):
        await VLLMEngine(tiny_model_path(0), small).start()  # refused before any engine process starts
