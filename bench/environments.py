"""Environment adapter cost: the same concurrent single-turn questions generated through
`rollout()` directly, as episodes of a verifiers environment (its own rollout and rubric, through
the run's OpenAI-compatible endpoint), as episodes of an OpenEnv environment (a session with
its server: reset, the model's turn, step), as episodes of a TRL environment class (an
instance, its reset, the model's turn with the tools shown, its get_reward), and as episodes of
a verifiers v1 taskset (the model's turn, its `vf.Trace`, the task's own rewards), and as episodes
of a v1 taskset whose tasks bring a toolset (calc-taskset: the toolset set up per episode on an
in-process MCP server, its tools shown), and as episodes of a taskset played by a verifiers `Env`
(sums-taskset with `env_id = "one-shot-env"`, bench/one_shot_env.py: one agent run each, through
verifiers' `Env.run_episode`, its interception server and trace, rollflow's in-process harness and
the run's endpoint), and as episodes of calc-taskset played by that `Env` (its task's toolset served
by rollflow in-process to each rollout, its tools listed and shown; verifiers gives a rollout whose
task has toolsets an interception server of its own), alternating for several rounds in one run.

Every path samples the same number of tokens per question (ignore_eos, fixed max_tokens) on one
in-process engine of the tiny model; the adapters add what they are: verifiers' rollout, the HTTP
round trip and the episode's recording for the one, a WebSocket session per episode with the
OpenEnv server (started by the bench, as `env.openenv_server` does) for the other. Prints a table
per adapter, each ending with its RESULT line, `RESULT verifiers_ratio=<x>`, `RESULT
openenv_ratio=<y>`, `RESULT factory_ratio=<z>`, `RESULT taskset_ratio=<w>`, `RESULT
tools_taskset_ratio=<v>`, `RESULT env_taskset_ratio=<u>` and `RESULT env_tools_ratio=<t>` (median
over rounds of the adapter's tokens/s divided by `rollout()`'s; 1.0 = no cost).

    bin/dev python bench/environments.py [--requests 32] [--tokens 128] [--rounds 12]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from sidebyside import alternate, engine_args, report

from rollflow.agent import AgentEpisode, AgentServer, run_agent
from rollflow.config import Config, EngineConfig, FactoryEnvConfig, VerifiersEnvConfig
from rollflow.engine.vllm import VLLMEngine
from rollflow.envs import ChatFormat, EpisodeLimits, run_episode
from rollflow.envs.factory import episodes
from rollflow.envs.openenv import OpenEnvSource
from rollflow.episodes import EpisodeContext, EpisodeSource
from rollflow.models import load_tokenizer, resolve_model
from rollflow.records import Prompt, Sample, SamplingSpec
from rollflow.rollout import rollout
from rollflow.verifiers.environments import VerifiersEnv
from rollflow.verifiers.tasksets import taskset_episodes

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "environments"


async def direct(engine, chat: ChatFormat, spec: SamplingSpec, prompts: list[Prompt], tag: str) -> int:
    samples = await asyncio.gather(
        *(rollout(engine, p, spec, group_id=f"{tag}-{i}", index=0) for i, p in enumerate(prompts))
    )
    return sum(s.num_tokens for s in samples)


def turns(engine, tag: str):
    async def generate(token_ids, turn_spec, n):
        return await rollout(engine, Prompt(id=tag, token_ids=token_ids), turn_spec, group_id=f"{tag}/{n}", index=0)

    return generate


async def verifiers(engine, chat, spec, server: AgentServer, env: VerifiersEnv, prompts, tag: str) -> int:
    limits = EpisodeLimits(max_turns=1, max_tokens=spec.max_tokens, max_model_len=engine.config.max_model_len)
    samples = await asyncio.gather(
        *(
            run_agent(env, AgentEpisode(p, spec, turns(engine, f"{tag}-{i}"), chat, limits), server, group_id=tag,
                      index=i, timeout_s=600)
            for i, p in enumerate(prompts)
        )
    )
    assert all(s.unscorable is None for s in samples), [s.unscorable for s in samples if s.unscorable][:1]
    return sum(sum(s.loss_mask) for s in samples)


async def openenv(engine, chat, spec, source: OpenEnvSource, prompts, tag: str) -> int:
    limits = EpisodeLimits(max_turns=1, max_tokens=spec.max_tokens, max_model_len=engine.config.max_model_len)

    async def episode(i: int, p: Prompt) -> Sample:
        env = await source()  # waits for a free session, as the producer's episodes do
        return await run_episode(env, p, spec, turns(engine, f"{tag}-{i}"), chat, group_id=tag, index=i, limits=limits)

    samples = await asyncio.gather(*(episode(i, p) for i, p in enumerate(prompts)))
    assert all(s.unscorable is None for s in samples), [s.unscorable for s in samples if s.unscorable][:1]
    return sum(sum(s.loss_mask) for s in samples)


async def episodes_of(engine, chat, spec, source: EpisodeSource, prompts, tag: str) -> int:
    """The prompts as concurrent episodes of `source` (TRL classes, a v1 taskset); trained tokens."""
    context = EpisodeContext(chat=chat, sampling=spec, max_model_len=engine.config.max_model_len)
    samples = await asyncio.gather(
        *(
            source.play(p, group_id=f"{tag}-{i}", index=0, generate=turns(engine, f"{tag}-{i}"), context=context)
            for i, p in enumerate(prompts)
        )
    )
    for i in range(len(prompts)):
        source.done(f"{tag}-{i}")
    assert all(s.unscorable is None for s in samples), [s.unscorable for s in samples if s.unscorable][:1]
    return sum(sum(s.loss_mask) for s in samples)


def prompts_of(chat, rows) -> list[Prompt]:
    """A source's rows as prompts, rendered with the chat template."""
    return [
        Prompt(id=r.id, token_ids=chat.tokens(chat.render(r.messages)), messages=r.messages, answer=r.answer,
               task=r.task, metadata=r.metadata)
        for r in rows
    ]  # fmt: skip


def taskset_of(
    chat: ChatFormat, spec: SamplingSpec, args: argparse.Namespace, taskset: str, env_id: str = ""
) -> tuple[EpisodeSource, list[Prompt]]:
    """`args.requests` tasks of a v1 taskset as a source of episodes (played by `env_id`'s Env when
    given), and as prompts."""
    settings = VerifiersEnvConfig(taskset=taskset, taskset_args={"n": args.requests}, max_tokens=args.tokens,
                                  env_id=env_id)  # fmt: skip
    source = taskset_episodes(settings, args.model, spec)
    return source, prompts_of(chat, source.rows())


async def main(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(EXAMPLES))
    import openenv_sums
    import trl_envs

    path = resolve_model(args.model)
    engine = VLLMEngine(path, EngineConfig(max_num_seqs=max(args.requests, 16), max_model_len=1024))
    chat = ChatFormat(load_tokenizer(path))
    spec = SamplingSpec(temperature=1.0, max_tokens=args.tokens, ignore_eos=True)
    env = VerifiersEnv("vf-sums", {"n": args.requests})
    prompts = prompts_of(chat, env.rows())
    server = AgentServer(args.model, spec)
    source = OpenEnvSource(openenv_sums.SumsClient, server="openenv_sums:app", sessions=args.requests)
    trl = episodes(FactoryEnvConfig(max_turns=1, max_tokens=args.tokens), Config(), trl_envs.SubmitEnv)
    taskset, task_prompts = taskset_of(chat, spec, args, "sums-taskset")
    tools, tool_prompts = taskset_of(chat, spec, args, "calc-taskset")
    game, game_prompts = taskset_of(chat, spec, args, "sums-taskset", env_id="one-shot-env")
    tool_game, tool_game_prompts = taskset_of(chat, spec, args, "calc-taskset", env_id="one-shot-env")
    try:
        await engine.start()
        await server.start()
        await source.start()
        await direct(engine, chat, spec, prompts[:4], "warmup")
        await verifiers(engine, chat, spec, server, env, prompts[:4], "warmup")
        await openenv(engine, chat, spec, source, prompts[:4], "warmup")
        await episodes_of(engine, chat, spec, trl, prompts[:4], "warmup")
        await episodes_of(engine, chat, spec, taskset, task_prompts[:4], "warmup")
        await tools.start()
        await episodes_of(engine, chat, spec, tools, tool_prompts[:4], "warmup")
        await game.start()
        await episodes_of(engine, chat, spec, game, game_prompts[:4], "warmup")
        await tool_game.start()
        await episodes_of(engine, chat, spec, tool_game, tool_game_prompts[:4], "warmup")
        through_verifiers = await alternate(
            [
                ("rollout() directly", lambda tag: direct(engine, chat, spec, prompts, tag)),
                ("verifiers episodes", lambda tag: verifiers(engine, chat, spec, server, env, prompts, tag)),
            ],
            args.rounds,
        )
        through_openenv = await alternate(
            [
                ("rollout() directly", lambda tag: direct(engine, chat, spec, prompts, tag)),
                ("OpenEnv episodes", lambda tag: openenv(engine, chat, spec, source, prompts, tag)),
            ],
            args.rounds,
        )
        through_factory = await alternate(
            [
                ("rollout() directly", lambda tag: direct(engine, chat, spec, prompts, tag)),
                ("TRL class episodes", lambda tag: episodes_of(engine, chat, spec, trl, prompts, tag)),
            ],
            args.rounds,
        )
        through_taskset = await alternate(
            [
                ("rollout() directly", lambda tag: direct(engine, chat, spec, prompts, tag)),
                ("v1 taskset episodes", lambda tag: episodes_of(engine, chat, spec, taskset, task_prompts, tag)),
            ],
            args.rounds,
        )
        through_tools = await alternate(
            [
                ("rollout() directly", lambda tag: direct(engine, chat, spec, prompts, tag)),
                ("v1 tasks with tools", lambda tag: episodes_of(engine, chat, spec, tools, tool_prompts, tag)),
            ],
            args.rounds,
        )
        through_env = await alternate(
            [
                ("rollout() directly", lambda tag: direct(engine, chat, spec, prompts, tag)),
                ("a verifiers Env", lambda tag: episodes_of(engine, chat, spec, game, game_prompts, tag)),
            ],
            args.rounds,
        )
        through_env_tools = await alternate(
            [
                ("rollout() directly", lambda tag: direct(engine, chat, spec, prompts, tag)),
                ("an Env with tools", lambda tag: episodes_of(engine, chat, spec, tool_game, tool_game_prompts, tag)),
            ],
            args.rounds,
        )
    finally:
        await tool_game.aclose()
        await game.aclose()
        await tools.aclose()
        await env.aclose()
        await source.aclose()
        await server.aclose()
        await engine.aclose()
    report(*through_verifiers, args, "verifiers_ratio")
    report(*through_openenv, args, "openenv_ratio")
    report(*through_factory, args, "factory_ratio")
    report(*through_taskset, args, "taskset_ratio")
    report(*through_tools, args, "tools_taskset_ratio")
    report(*through_env, args, "env_taskset_ratio")
    report(*through_env_tools, args, "env_tools_ratio")


if __name__ == "__main__":
    asyncio.run(main(engine_args(__doc__, rounds=12)))  # short rounds: more of them for a stable median
