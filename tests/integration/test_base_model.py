"""Base models without a chat template: raw prompts train; chat prompts are one clear error."""

from __future__ import annotations

import json
import shutil

import pytest

from rollflow.config import load_config
from rollflow.controller import Controller
from rollflow.errors import UserInputError
from rollflow.models import load_tokenizer, prompt_encoder, tiny_model_path
from rollflow.sampler import Sampler

pytestmark = pytest.mark.integration


@pytest.fixture
def base_model(tmp_path):
    """The tiny model with its chat template removed, as a base model comes."""
    folder = tmp_path / "base"
    shutil.copytree(tiny_model_path(0), folder)
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config.pop("chat_template", None)
    config_file.write_text(json.dumps(config))
    assert not load_tokenizer(folder).chat_template
    return folder


async def test_chat_prompts_on_a_base_model_are_refused_at_start_naming_the_fix(base_model, tmp_path):
    config = load_config(preset="tiny", overrides=[f'model.path="{base_model}"'])
    with pytest.raises(UserInputError, match=r'has no chat template \(a base model\?\); set data.template = "raw"'):
        await Controller(config, tmp_path / "run").run()


@pytest.mark.timeout(300)
async def test_a_raw_prompt_run_on_a_base_model_trains(base_model, tmp_path):
    config = load_config(
        preset="tiny",
        overrides=[
            f'model.path="{base_model}"',
            'data.template="raw"',
            'data.prompt_format="Question: {prompt}\\nAnswer:"',
            "run.max_steps=2",
            "observe.sinks=[]",
        ],
    )
    tokenizer = load_tokenizer(base_model)
    prompt = Sampler(config.data, prompt_encoder(tokenizer, config.data)).next()
    text = tokenizer.decode(prompt.token_ids, skip_special_tokens=True)
    assert text == f"Question: {prompt.messages[0].content}\nAnswer:"
    result = await Controller(config, tmp_path / "run").run()
    assert result.steps == 2 and result.trained_prompts > 0
    assert all(m["tokens"] > 0 for m in result.metrics)
