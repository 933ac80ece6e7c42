"""Config loading: presets, files, overrides, and errors that name the key."""

from __future__ import annotations

import json
import re
import tomllib

import pytest

from rollflow.config import Config, config_from_dict, dump_config, load_config
from rollflow.errors import ConfigError


def test_defaults_and_presets_load():
    assert load_config() == Config()
    tiny = load_config(preset="tiny")
    assert tiny.model.path == "tiny"
    assert load_config(preset="default").model.path == "smollm2-135m-instruct"


def test_file_then_overrides(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[sampling]\nmax_tokens = 12\ntemperature = 0.7\n[data]\ntask = "countdown"\n')
    cfg = load_config(path, preset="tiny", overrides=["sampling.max_tokens=40", "rollout.partial=resume"])
    assert cfg.sampling.max_tokens == 40
    assert cfg.sampling.temperature == 0.7
    assert cfg.data.task == "countdown"
    assert cfg.rollout.partial == "resume"


def test_sampling_section_reaches_the_engine_spec():
    from rollflow.sampler import sampling_spec

    cfg = load_config(overrides=["sampling.ignore_eos=true", "sampling.top_k=20", "sampling.max_tokens=7"])
    spec = sampling_spec(cfg)
    assert (spec.ignore_eos, spec.top_k, spec.max_tokens) == (True, 20, 7)
    assert sampling_spec(load_config()).ignore_eos is False
    greedy = sampling_spec(cfg, greedy=True)  # evaluation: greedy, stops at the end of the answer
    assert (greedy.temperature, greedy.ignore_eos, greedy.max_tokens) == (0.0, False, 7)


def test_resolved_config_round_trips_through_toml():
    cfg = load_config(preset="default", overrides=["data.paths=['a.jsonl', 'b.jsonl']"])
    assert config_from_dict(tomllib.loads(dump_config(cfg))) == cfg


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[engine]\nmax_num_seq = 3\n", "unknown key `engine.max_num_seq`"),
        ("[sampling]\nmax_tokens = 'many'\n", "`sampling.max_tokens`: Expected `int`, got `str`"),
        ("[sampling]\ntop_p = 1.5\n", "`sampling.top_p`: Expected `float` <= 1.0"),
        ("[rollout]\npartial = 'sometimes'\n", "`rollout.partial`: Invalid enum value 'sometimes'"),
        ("colour = 'blue'\n", "unknown key `colour`"),
        ("[sampling\n", "invalid TOML"),
    ],
)
def test_bad_config_names_file_and_key(tmp_path, text, expected):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(path) in str(info.value)
    assert expected in str(info.value)


def test_bad_override_and_preset_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="expected KEY.PATH=VALUE"):
        load_config(overrides=["sampling.max_tokens"])
    with pytest.raises(ConfigError, match="unknown key `engine.nope`"):
        load_config(overrides=["engine.nope=1"])
    with pytest.raises(ConfigError, match="unknown preset 'huge'"):
        load_config(preset="huge")
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "absent.toml")


def test_a_cosine_schedule_without_its_length_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"trainer\.total_steps: the cosine schedule .* got 0"):
        load_config(preset="tiny", overrides=["trainer.schedule=cosine"])
    with pytest.raises(ConfigError, match=r"trainer\.total_steps: .*trainer\.warmup_steps \(5\); got 5"):
        load_config(overrides=["trainer.schedule=cosine", "trainer.warmup_steps=5", "trainer.total_steps=5"])
    assert load_config(overrides=["trainer.schedule=cosine", "trainer.total_steps=20"]).trainer.total_steps == 20


def test_a_bfloat16_head_without_autocast_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"trainer\.autocast_head: only used with trainer\.autocast"):
        load_config(preset="tiny", overrides=["trainer.autocast_head=true"])
    config = load_config(preset="tiny", overrides=["trainer.autocast_head=true", "trainer.autocast=bfloat16"])
    assert config.trainer.autocast_head


async def test_greedy_sampling_is_refused_for_training_before_anything_is_written(tmp_path):
    from rollflow.controller import Controller

    config = load_config(preset="tiny", overrides=["sampling.temperature=0"])  # fine for `generate`
    with pytest.raises(ConfigError, match=r"sampling\.temperature: training samples need a temperature > 0"):
        Controller(config, tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_the_cli_refuses_greedy_training_with_exit_code_2(tmp_path, capsys, monkeypatch):
    from rollflow.__main__ import main

    monkeypatch.setenv("ROLLFLOW_NO_UVLOOP", "1")  # keep the test session's event loop policy
    code = main(["train", "--preset", "tiny", "--set", "sampling.temperature=0", "--output-dir", str(tmp_path / "r")])
    assert code == 2 and "sampling.temperature" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (["sampling.max_tokens=1024"], "sampling.max_tokens: 1024 completion tokens leave no room"),
        (["data.paths=['a.jsonl']"], 'data.paths: files are read only by data.task = "jsonl"'),
        (["loss.is_mode=mis", "loss.is_low=2.0", "loss.is_high=2.0"], r"loss.is_low: the kept ratio range \[2.0"),
        (["trainer.lora.enabled=true", "engine.max_loras=2", "run.max_lag=1"], "engine.max_loras: 2 adapters"),
        (["run.weight_transport=nccl"], 'run.weight_transport: "nccl" needs'),
        (["run.eval_every=5"], r"run.eval_every: evaluating during training needs held-out prompts"),
        (['env.kind="tool"', 'env.name="calculator"', 'data.template="raw"'],
         r"data.template: environments and agents render"),
        (["rollout.overlong=soft"], r'rollout.overlong_buffer: the "soft" penalty needs a buffer between 1 and'),
        (["run.eval_pass_k=4"], r"run.eval_pass_k: pass@k is measured on the held-out prompts"),
        (['env.kind="openenv"', 'env.client="m:C"'], r"env.url: kind = \"openenv\" needs the server's address"),
        (['env.kind="agent"', 'env.function="m:f"', "env.time_budget_s=60", "env.episode_timeout_s=60"],
         r"env.time_budget_s: 60 s is not below env.episode_timeout_s \(60 s\)"),
    ],
)
def test_combinations_that_cannot_work_are_refused_for_training_naming_the_keys(tmp_path, overrides, words):
    from rollflow.controller import Controller

    config = load_config(preset="tiny", overrides=overrides)  # each value alone is valid
    with pytest.raises(ConfigError, match=words):
        Controller(config, tmp_path / "run")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (['data.prompt_format="Q: {prompt}"'], 'data.prompt_format: only used with data.template = "raw"'),
        (['data.template="raw"', 'data.prompt_format="Q: {question}"'], r"not a format with one \{prompt\} field"),
        (['data.template="raw"', 'data.prompt_format="Q:"'], r"expected \{prompt\} where the prompt text goes"),
        (["data.columns={question = 'query'}"], r"data.columns: 'question' maps to 'query'; expected prompt, messages"),
    ],
)
def test_a_prompt_format_without_its_field_is_refused(overrides, words):
    with pytest.raises(ConfigError, match=words):
        load_config(preset="tiny", overrides=overrides)


def test_the_default_and_tiny_presets_have_no_training_problem():
    from rollflow.checks import training_problems

    assert training_problems(load_config(preset="tiny")) == []
    assert training_problems(load_config(preset="default")) == []
    assert training_problems(load_config(preset="tiny", overrides=["trainer.lora.enabled=true"])) == []


def test_config_files_that_are_not_utf8_are_refused_naming_the_file_and_a_byte_order_mark_is_dropped(tmp_path):
    binary = tmp_path / "run.toml"
    binary.write_bytes(b"[run]\nmax_steps = 3\n\xff\xfe\x00")
    with pytest.raises(ConfigError, match=rf"{binary}: not UTF-8 text \(byte 20"):
        load_config(binary)
    bom = tmp_path / "bom.toml"
    bom.write_bytes(b"\xef\xbb\xbf[run]\nmax_steps = 3\n")
    assert load_config(bom).run.max_steps == 3


def _model_dir(tmp_path, **config):
    tmp_path.mkdir(parents=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_max_model_len_defaults_to_the_models_own_limit_capped(tmp_path):
    from rollflow.config import CONTEXT_CAP, EngineConfig
    from rollflow.engine.environment import resolve_context

    auto = EngineConfig()
    assert auto.max_model_len == 0
    assert resolve_context(auto, _model_dir(tmp_path / "a", max_position_embeddings=256)).max_model_len == 256
    assert resolve_context(auto, _model_dir(tmp_path / "b", max_position_embeddings=8192)).max_model_len == CONTEXT_CAP
    nested = _model_dir(tmp_path / "c", text_config={"max_position_embeddings": 512})
    assert resolve_context(auto, nested).max_model_len == 512
    assert resolve_context(auto, tmp_path / "missing").max_model_len == CONTEXT_CAP
    explicit = EngineConfig(max_model_len=300)
    assert resolve_context(explicit, tmp_path / "a").max_model_len == 300  # the user's word stands


def test_a_completion_budget_beyond_the_models_limit_is_refused_naming_it(tmp_path):
    from rollflow.controller.setup import with_context

    model = _model_dir(tmp_path / "m", max_position_embeddings=256)
    config = load_config(preset="tiny", overrides=["engine.max_model_len=0", "sampling.max_tokens=300"])
    with pytest.raises(ConfigError, match=r"sampling.max_tokens: 300 .* engine.max_model_len = 256 .* allows 256"):
        with_context(config, model)
    fits = load_config(preset="tiny", overrides=["engine.max_model_len=0", "sampling.max_tokens=64"])
    assert with_context(fits, model).engine.max_model_len == 256


def test_the_engine_is_started_with_the_resolved_context(tmp_path):
    """What reaches vLLM (in process and as a server) is the model's 256, not the former fixed 1024,
    which vLLM refuses to start with for a model allowing 256 positions."""
    from rollflow.config import EngineConfig
    from rollflow.engine.environment import engine_args, serve_command
    from rollflow.engine.vllm import VLLMEngine

    model = _model_dir(tmp_path / "short", max_position_embeddings=256)
    engine = VLLMEngine(model)
    assert engine.config.max_model_len == 256
    assert engine_args(str(model), engine.config, "float32").max_model_len == 256
    command = serve_command(model, EngineConfig(), host="127.0.0.1", port=1, dtype="float32")
    assert command[command.index("--max-model-len") + 1] == "256"


def test_groups_whose_samples_in_flight_cannot_fit_in_memory_are_refused_at_load():
    from rollflow.checks import in_flight_samples, training_problems

    gib = 1024**3
    huge = load_config(preset="tiny", overrides=["rollout.group_size=100000"])
    # 4 groups per step, max_lag 1: up to 2 steps' samples are started before the first step.
    assert in_flight_samples(huge) == 2 * 4 * 100000
    problems = training_problems(huge, memory_bytes=24 * gib)
    assert len(problems) == 1
    for words in ("rollout.group_size: 100000", "800,000 samples in flight", "run.groups_per_step = 4",
                  "run.max_lag = 1", "24.0 GiB this machine gives it", "lower rollout.group_size"):
        assert words in problems[0], words
    # The same size fits a machine with more memory, and ordinary sizes fit a small one.
    assert training_problems(huge, memory_bytes=1024 * gib) == []
    assert training_problems(load_config(preset="default"), memory_bytes=4 * gib) == []
    # Longer completions cost more per sample: the same group size that fits with short ones does not.
    short = load_config(preset="tiny", overrides=["rollout.group_size=4000"])
    long = load_config(preset="tiny", overrides=["rollout.group_size=4000", "sampling.max_tokens=8000",
                                                 "engine.max_model_len=8192"])
    assert training_problems(short, memory_bytes=24 * gib) == []
    assert "rollout.group_size: 4000" in training_problems(long, memory_bytes=24 * gib)[0]


def test_the_memory_a_run_may_use_is_the_containers_limit_where_that_is_lower(tmp_path):
    from rollflow.checks import machine_memory

    physical = machine_memory(limits=())
    v2, v1 = tmp_path / "memory.max", tmp_path / "memory.limit_in_bytes"
    v2.write_text("max\n")  # no limit
    v1.write_text(f"{2 * 1024**3}\n")
    assert machine_memory(limits=(str(v2),)) == physical
    assert machine_memory(limits=(str(v2), str(v1))) == min(physical, 2 * 1024**3)
    assert machine_memory(limits=(str(tmp_path / "absent"),)) == physical


def test_the_linear_layout_reaches_every_engine_process_and_is_checked(monkeypatch):
    from rollflow.engine.environment import LINEAR_LAYOUT, engine_environment, prepare_environment, serve_environment

    assert load_config().engine.linear_layout == "staged"
    tiny = load_config(preset="tiny").engine
    assert tiny.linear_layout == "plain"
    assert engine_environment(tiny)[LINEAR_LAYOUT] == "plain"
    import os

    monkeypatch.setattr(os, "environ", dict(os.environ))  # what prepare_environment sets goes with the test
    # An earlier engine's setting left in this process's environment never wins over this one's.
    os.environ[LINEAR_LAYOUT] = "packed"
    assert serve_environment(tiny)[LINEAR_LAYOUT] == "plain"
    os.environ["VLLM_RPC_BASE_PATH"] = "/tmp"  # no socket folder for this test
    prepare_environment(tiny)
    assert os.environ[LINEAR_LAYOUT] == "plain"
    with pytest.raises(ConfigError, match=r"engine.linear_layout.*'staged', 'packed', 'plain'"):
        load_config(overrides=["engine.linear_layout=blocked"])


def test_cpu_engines_use_the_compile_cache_that_loads(monkeypatch):
    """vLLM 0.32's CPU build cannot load the AOT artifacts it saves; CPU engines turn them off,
    unless the user's environment says otherwise."""
    import os

    import torch

    from rollflow.engine.environment import engine_environment, prepare_environment

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    engine = load_config(preset="tiny").engine
    assert engine_environment(engine)["VLLM_USE_AOT_COMPILE"] == "0"
    monkeypatch.setattr(os, "environ", dict(os.environ, VLLM_RPC_BASE_PATH="/tmp", VLLM_USE_AOT_COMPILE="1"))
    prepare_environment(engine)
    assert os.environ["VLLM_USE_AOT_COMPILE"] == "1"


def test_eager_mode_reaches_the_engine_in_process_and_as_a_server(tmp_path):
    from rollflow.config import EngineConfig
    from rollflow.engine.environment import engine_args, serve_command

    model = _model_dir(tmp_path / "m", max_position_embeddings=256)
    assert not load_config(preset="tiny").engine.enforce_eager  # vLLM's default: compiled
    for eager in (False, True):
        config = EngineConfig(enforce_eager=eager, max_model_len=256)
        assert engine_args(str(model), config, "float32").enforce_eager is eager
        assert ("--enforce-eager" in serve_command(model, config, host="127.0.0.1", port=1, dtype="float32")) is eager


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("env.name=calculator", '[env] kind = "tool", name = "calculator"'),
        ("env.agent=m:f", '[env] kind = "agent", function = "m:f"'),
        ("env.verifiers=vf-sums", '[env] kind = "verifiers", environment = "vf-sums"'),
        ("env.openenv=m:C", '[env] kind = "openenv", client = "m:C"'),
        ("env.openenv_url=http://127.0.0.1:1", '[env] kind = "openenv", url = "http://127.0.0.1:1"'),
    ],
)
def test_the_flat_env_keys_of_earlier_releases_are_refused_showing_the_new_form(old, new):
    """`[env]` is a tagged union now: a key of the old flat form would silently mean something
    else (or nothing), so it is refused in one line that shows what to write."""
    with pytest.raises(ConfigError, match=re.escape(f"{old.split('=')[0]}: [env] names its kind now; write {new}")):
        load_config(preset="tiny", overrides=[old])


def test_env_kinds_load_with_their_own_settings_and_a_run_config_of_an_earlier_release_still_loads(tmp_path):
    config = load_config(overrides=["env.kind=openenv", "env.client=m:C", "env.url=http://h", "env.max_turns=2"])
    assert config.env is not None and config.env.__struct_config__.tag == "openenv"
    assert (config.env.client, config.env.url, config.env.max_turns, config.env.sessions) == ("m:C", "http://h", 2, 8)
    assert load_config(overrides=["env.kind=tool", "env.name=retry"]).completion_budget == 256
    with pytest.raises(ConfigError, match=r"env: give the kind of episodes, kind = 'tool' \| 'agent'"):
        load_config(overrides=["env.max_turns=3"])
    with pytest.raises(ConfigError, match=r"env.kind: 'gym' is not one"):
        load_config(overrides=["env.kind=gym"])
    # what earlier releases wrote into every run's config.toml: the flat table, no source set
    old = tmp_path / "config.toml"
    old.write_text('[env]\nname = ""\nagent = ""\nverifiers = ""\nopenenv = ""\nmax_turns = 4\n')
    assert load_config(old).env is None
