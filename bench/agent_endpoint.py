"""Agent endpoint cost: the same concurrent chat requests generated through `rollout()` directly
and through the run's endpoint (`rollflow.agent`) by the official clients, one episode per request,
alternating for several rounds in one run.

Both paths render the same messages with the chat template and sample the same number of tokens
(ignore_eos, fixed max_tokens) on one in-process engine; the endpoint path adds the client, the
HTTP round trip, the JSON bodies, the request checks and the episode's recording. Each dialect
runs with its client's own HTTP stack (httpx) shared by every episode, and again on one shared
`rollflow.agent.http.http_client()` (httpx's interface over aiohttp's pool). Prints a table per
path and its `RESULT` (median over rounds of the endpoint's tokens/s divided by direct tokens/s;
1.0 = no cost): a client made per episode (`agent_endpoint_ratio_client_per_episode`), OpenAI's
Responses API with the `openai` client (`responses_ratio`, `responses_ratio_aiohttp`),
Anthropic's Messages API with the `anthropic` client, the episode chosen by its key on the run's
one URL (`anthropic_ratio`, `anthropic_ratio_aiohttp`), chat completions with the `openai`
client on aiohttp's pool (`agent_endpoint_ratio_aiohttp`) and, last, on its own
(`agent_endpoint_ratio`).

`--instant` measures what each path costs the event loop instead, on an engine that answers every
request at once (`sidebyside.InstantEngine`: no model, no engine process): the process's CPU
milliseconds per request, median over rounds, for each path above and for plain aiohttp requests
with no client library (`raw`: the endpoint's own cost and a minimal client's), and, last,
`RESULT cpu_ms_direct=... cpu_ms_raw=... cpu_ms_<path>=...`. On two cores that CPU is taken from
the engine, so it is what the ratios above lose.

    bin/dev python bench/agent_endpoint.py [--requests 32] [--tokens 128] [--rounds 30] [--instant]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import anthropic
import machine
import openai
from sidebyside import InstantEngine, alternate, engine_args, frozen_heap, report

from rollflow.agent import AgentEpisode, AgentServer, run_agent
from rollflow.agent.http import http_client
from rollflow.config import EngineConfig
from rollflow.engine.vllm import VLLMEngine
from rollflow.envs import ChatFormat, EpisodeLimits
from rollflow.models import load_tokenizer, resolve_model
from rollflow.records import Message, Prompt, SamplingSpec
from rollflow.rollout import rollout

MAX_MODEL_LEN = 1024


def questions(n: int) -> list[list[Message]]:
    return [[Message(role="user", content=f"What is {i} + {2 * i + 1}?")] for i in range(n)]


async def direct(engine, chat: ChatFormat, spec: SamplingSpec, conversations, tag: str) -> int:
    samples = await asyncio.gather(
        *(
            rollout(engine, Prompt(id=f"{tag}-{i}", token_ids=chat.tokens(chat.render(m))), spec,
                    group_id=f"{tag}-{i}", index=0)
            for i, m in enumerate(conversations)
        )
    )
    return sum(s.num_tokens for s in samples)


async def through_endpoint(
    engine, chat, spec, server: AgentServer, conversations, tag: str, http=None, dialect: str = "openai"
) -> int:
    """`http`: one HTTP client for every episode's client (None: each makes its own, which costs
    it an SSL context, about 50 ms of CPU on this machine, even for plain HTTP). `dialect`:
    `openai` (chat completions on the episode's URL), `responses` (the Responses API there),
    `anthropic` (Messages on the run's URL) or `raw` (chat completions posted by `http`, an
    aiohttp session, with no client library)."""
    made = []

    async def agent(task, base_url):
        if dialect == "raw":
            call = {"model": task.model, "messages": task.messages, "max_tokens": spec.max_tokens}
            async with http.post(f"{base_url}/chat/completions", json=call) as answer:
                made.append((await answer.json())["usage"]["completion_tokens"])
            return
        if dialect == "anthropic":
            messages = [{"role": "user", "content": task.prompt}]
            claude = anthropic.AsyncAnthropic(base_url=task.endpoint, api_key=task.api_key, max_retries=0,
                                              http_client=http)
            message = await claude.messages.create(model=task.model, messages=messages, max_tokens=spec.max_tokens)
            made.append(message.usage.output_tokens)
            return
        client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, http_client=http)
        if dialect == "responses":
            response = await client.responses.create(model=task.model, input=task.messages,
                                                     max_output_tokens=spec.max_tokens)
            made.append(response.usage.output_tokens)
            return
        reply = await client.chat.completions.create(model=task.model, messages=task.messages,
                                                     max_tokens=spec.max_tokens)
        if http is None:
            await client.close()
        made.append(reply.usage.completion_tokens)

    async def generate(token_ids, turn_spec, n):
        return await rollout(engine, Prompt(id=tag, token_ids=token_ids), turn_spec, group_id=f"{tag}/{n}", index=0)

    limits = EpisodeLimits(max_turns=1, max_tokens=spec.max_tokens, max_model_len=MAX_MODEL_LEN)
    samples = await asyncio.gather(
        *(
            run_agent(agent, AgentEpisode(Prompt(id=f"{tag}-{i}", token_ids=[], messages=m), spec, generate, chat,
                                          limits), server, group_id=tag, index=i, timeout_s=600)
            for i, m in enumerate(conversations)
        )
    )
    failed = [s.unscorable for s in samples if s.unscorable]
    if failed:  # a path whose agents fail would only look cheap
        raise RuntimeError(f"{tag}: {len(failed)} of {len(samples)} episodes failed, the first: {failed[0]}")
    return sum(made)


@contextlib.asynccontextmanager
async def shared_clients() -> AsyncIterator[tuple[Any, ...]]:
    """The HTTP clients every episode's client shares: the `openai` client's own (httpx), one on
    aiohttp's pool for it (`rollflow.agent.http.http_client()`), the `anthropic` client's own and
    one on aiohttp's pool for it."""
    clients = (openai.DefaultAsyncHttpxClient(), http_client(), anthropic.DefaultAsyncHttpxClient(),
               http_client(sdk="anthropic"))  # fmt: skip
    try:
        yield clients
    finally:
        for client in clients:
            await client.aclose()


def paths(engine, chat, spec, server, conversations, clients) -> dict[str, tuple[str, Callable[[str], Any]]]:
    """Each path's key -> (its name, tag -> its round's tokens)."""
    http, pooled, claude_http, claude_pooled = clients

    def endpoint(*how):
        return lambda tag: through_endpoint(engine, chat, spec, server, conversations, tag, *how)

    return {
        "direct": ("rollout() directly", lambda tag: direct(engine, chat, spec, conversations, tag)),
        "per_episode": ("chat, a client per episode", endpoint()),
        "responses": ("Responses API, httpx", endpoint(http, "responses")),
        "responses_aiohttp": ("Responses API, aiohttp pool", endpoint(pooled, "responses")),
        "messages": ("Messages API, httpx", endpoint(claude_http, "anthropic")),
        "messages_aiohttp": ("Messages API, aiohttp pool", endpoint(claude_pooled, "anthropic")),
        "aiohttp": ("chat, aiohttp pool", endpoint(pooled)),
        "chat": ("chat, httpx", endpoint(http)),
    }


RATIOS = {
    "per_episode": "agent_endpoint_ratio_client_per_episode",
    "responses": "responses_ratio",
    "responses_aiohttp": "responses_ratio_aiohttp",
    "messages": "anthropic_ratio",
    "messages_aiohttp": "anthropic_ratio_aiohttp",
    "aiohttp": "agent_endpoint_ratio_aiohttp",
    "chat": "agent_endpoint_ratio",
}
"""Each endpoint path's RESULT key, in the order they run (the chat path's, the headline, last)."""


async def main(args: argparse.Namespace) -> None:
    path = resolve_model(args.model)
    engine = VLLMEngine(path, EngineConfig(max_num_seqs=max(args.requests, 16), max_model_len=MAX_MODEL_LEN))
    chat = ChatFormat(load_tokenizer(path))
    spec = SamplingSpec(temperature=1.0, max_tokens=args.tokens, ignore_eos=True)
    server = AgentServer(args.model, spec)
    results = {}
    async with shared_clients() as clients:
        each = paths(engine, chat, spec, server, questions(args.requests), clients)
        warmups = paths(engine, chat, spec, server, questions(4), clients)
        try:
            await engine.start()
            await server.start()
            for key in ("direct", "chat", "messages", "responses"):
                await warmups[key][1]("warmup")
            for key in RATIOS:
                results[key] = await alternate([each["direct"], each[key]], args.rounds)
        finally:
            await server.aclose()
            await engine.aclose()
    for key, (totals, ratios) in results.items():
        report(totals, ratios, args, RATIOS[key])


async def instant(args: argparse.Namespace) -> None:
    """`--instant`: the event loop's CPU per request of each path, on an engine that costs nothing."""
    engine = InstantEngine(args.tokens)
    chat = ChatFormat(load_tokenizer(resolve_model(args.model)))
    spec = SamplingSpec(temperature=1.0, max_tokens=args.tokens, ignore_eos=True)
    server = AgentServer(args.model, spec)
    ms: dict[str, float] = {}
    conversations = questions(args.requests)
    async with shared_clients() as clients, aiohttp.ClientSession() as session:
        each = paths(engine, chat, spec, server, conversations, clients)
        raw = ("chat, plain aiohttp requests",
               lambda tag: through_endpoint(engine, chat, spec, server, conversations, tag, session, "raw"))
        each = {"direct": each.pop("direct"), "raw": raw, **each}
        await server.start()
        try:
            for _, run in each.values():
                await run("warmup")
            with frozen_heap():  # as in the rounds with an engine (`sidebyside.alternate`)
                for key, (_, run) in each.items():
                    per_round = []
                    for r in range(args.rounds):
                        began = time.process_time()
                        await run(f"{key[:2]}{r}")
                        per_round.append((time.process_time() - began) * 1000 / args.requests)
                    ms[key] = statistics.median(per_round)
        finally:
            await server.aclose()
    width = max(len(name) for name, _ in each.values()) + 2
    print(f"{'path':<{width}}{'CPU ms/request':>16}{'over direct':>13}")
    for key, (name, _) in each.items():
        print(f"{name:<{width}}{ms[key]:>16.3f}{ms[key] - ms['direct']:>13.3f}")
    print(f"requests={args.requests} tokens/request={args.tokens} rounds={args.rounds} model={args.model} (no engine)")
    print(machine.describe())
    print("RESULT " + " ".join(f"cpu_ms_{key}={value:.3f}" for key, value in ms.items()))


if __name__ == "__main__":
    # short rounds (about 0.5 s with the engine): many, for a stable median
    parsed = engine_args(__doc__, rounds=30, switches={"--instant": "the event loop's CPU per request, no engine"})
    asyncio.run(instant(parsed) if parsed.instant else main(parsed))
