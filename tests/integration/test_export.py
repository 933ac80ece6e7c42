"""The trained policy out of a run: `final/` at the end, `rollflow export` from a checkpoint. The
folders load with transformers, vLLM and peft and generate what the trainer's weights generate;
a new run starts from `final/`; `eval`'s report on it reproduces the run's own evaluation."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from rollflow.config import load_config
from rollflow.controller import Controller, RunResult
from rollflow.controller.setup import Given
from rollflow.evaluate import held_out_report
from rollflow.export import export_checkpoint
from rollflow.models import tiny_model_path
from rollflow.records import SamplingSpec
from rollflow.testing import greedy_tokens

pytestmark = pytest.mark.integration

PROMPT = [1, 735, 202, 276, 261, 264, 277, 281, 34, 2, 202, 1, 871, 202]


async def trained(tmp_path, *overrides: str, engine=None) -> tuple[Controller, RunResult]:
    config = load_config(preset="tiny", overrides=["run.max_steps=2", "observe.sinks=[]", *overrides])
    controller = Controller(config, tmp_path, given=Given(engine=engine))
    result = await controller.run()
    assert result.steps == 2 and result.final_model == str((tmp_path / "final").absolute())
    return controller, result


@pytest.mark.timeout(600)
async def test_final_model_generates_as_the_trainer_in_transformers_and_vllm_and_starts_a_new_run(
    tmp_path, tiny_preset_engine
):
    from transformers import AutoModelForCausalLM

    from rollflow.engine.vllm import VLLMEngine

    run = tmp_path / "run"
    controller, result = await trained(
        run, "run.eval_prompts=6", "run.eval_every=1", "run.eval_pass_k=2", engine=await tiny_preset_engine()
    )
    # Evaluated during training after step 1; the last step's weights are scored after the run.
    assert {"eval_accuracy", "eval_pass_at_k", "eval_s"} <= result.metrics[0].keys()
    assert "eval_accuracy" not in result.metrics[1] and 0 <= result.metrics[0]["eval_pass_at_k"] <= 1
    trainer_lm = controller.trainer.lm.eval()
    final = run / "final"
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= {
        p.name for p in final.iterdir()
    }
    from rollflow.models import load_tokenizer

    assert load_tokenizer(final).chat_template == load_tokenizer(tiny_model_path(0)).chat_template
    loaded = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32).eval()
    for name, tensor in trainer_lm.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    want = greedy_tokens(trainer_lm, PROMPT, 16)
    assert want != greedy_tokens(AutoModelForCausalLM.from_pretrained(tiny_model_path(0)).eval(), PROMPT, 16)
    assert greedy_tokens(loaded, PROMPT, 16) == want

    # vLLM serves final/ as the trainer's weights; `eval`'s report on it reproduces the run's own
    # after-training accuracy (the same held-out prompts); a new run starts from it (on that engine).
    config = load_config(preset="tiny", overrides=[f'model.path="{final}"', "run.max_steps=1", "observe.sinks=[]"])
    engine = VLLMEngine(final, config.engine)
    await engine.start()
    try:
        out = await engine.generate(PROMPT, SamplingSpec(temperature=0.0, max_tokens=16, ignore_eos=True), "final")
        assert out.token_ids == want
        run_config = load_config(run / "config.toml", overrides=[f'model.path="{final}"'])
        report = await held_out_report(engine, run_config, load_tokenizer(final), 6, 2)
        assert result.eval_after is not None and report["accuracy"] == pytest.approx(result.eval_after.accuracy)
        assert report["prompts"] == 6 and report["k"] == 2 and 0.0 <= report["pass_at_k"] <= 1.0
        assert report["model"] == str(final) and json.loads(json.dumps(report)) == report
        second = await Controller(config, tmp_path / "second", given=Given(engine=engine)).run()
    finally:
        await engine.aclose()
    assert second.steps == 1
    assert greedy_tokens(AutoModelForCausalLM.from_pretrained(tmp_path / "second" / "final").eval(), PROMPT, 4)

    # The same folder from the checkpoint of step 2 (the run's last), through the command line.
    exported = tmp_path / "exported"
    done = subprocess.run(
        [sys.executable, "-m", "rollflow", "export", str(run), "--step", "2", "--out", str(exported)],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == str(exported.absolute())
    again = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32)
    assert all(torch.equal(again.state_dict()[k], v) for k, v in loaded.state_dict().items())


@pytest.mark.timeout(600)
async def test_a_lora_runs_final_is_a_peft_adapter_and_merged_export_is_the_same_model(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run = tmp_path / "run"
    controller, _ = await trained(run, "trainer.lora.enabled=true", "trainer.lr=0.02")
    want = greedy_tokens(controller.trainer.lm.eval(), PROMPT, 16)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path(0)).eval()
    assert want != greedy_tokens(base, PROMPT, 16), "the adapter must change the model for the test to mean anything"
    final = run / "final"
    adapter = json.loads((final / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == str(tiny_model_path(0)) and adapter["r"] == 8
    with_adapter = PeftModel.from_pretrained(base, final).eval()
    assert greedy_tokens(with_adapter, PROMPT, 16) == want

    merged = export_checkpoint(run, merged=True)
    assert merged == run / "export" / "step-2-merged"
    assert greedy_tokens(AutoModelForCausalLM.from_pretrained(merged).eval(), PROMPT, 16) == want
    assert not (merged / "adapter_config.json").exists()


def test_export_refuses_what_it_cannot_do(tmp_path):
    from rollflow.errors import UserInputError

    with pytest.raises(UserInputError, match="not a rollflow run directory"):
        export_checkpoint(tmp_path)
    (tmp_path / "config.toml").write_text('[model]\npath = "tiny"\n')
    with pytest.raises(UserInputError, match="no checkpoint at all"):
        export_checkpoint(tmp_path)
