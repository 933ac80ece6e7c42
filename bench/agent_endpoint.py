"""Agent endpoint cost: the same concurrent chat requests generated through `rollout()` directly
and through the run's OpenAI-compatible endpoint (`rollflow.agent`) by the `openai` client, one
episode per request, alternating for several rounds in one run.

Both paths render the same messages with the chat template and sample the same number of tokens
(ignore_eos, fixed max_tokens) on one in-process engine; the endpoint path adds the HTTP round
trip, the JSON bodies, the request checks and the episode's recording. Prints a table and, last,
`RESULT agent_endpoint_ratio=<x>` (median over rounds of endpoint tokens/s divided by direct
tokens/s; 1.0 = no cost) with one HTTP client shared by the episodes' `openai` clients, after
the same figure with a client made per episode (`agent_endpoint_ratio_client_per_episode`), with
one shared client on aiohttp's pool, `rollflow.agent.http.http_client()`
(`agent_endpoint_ratio_aiohttp`), through OpenAI's Responses API with the `openai` client on one
shared HTTP client (`responses_ratio`), and through Anthropic's Messages API with the `anthropic`
client on one shared HTTP client, the episode chosen by its key on the run's one URL
(`anthropic_ratio`).

    bin/dev python bench/agent_endpoint.py [--requests 32] [--tokens 128] [--rounds 12]
"""

from __future__ import annotations

import argparse
import asyncio

import anthropic
import openai
from sidebyside import alternate, engine_args, report

from rollflow.agent import AgentEpisode, AgentServer, run_agent
from rollflow.agent.http import http_client
from rollflow.config import EngineConfig
from rollflow.engine.vllm import VLLMEngine
from rollflow.envs import ChatFormat, EpisodeLimits
from rollflow.models import load_tokenizer, resolve_model
from rollflow.records import Message, Prompt, SamplingSpec
from rollflow.rollout import rollout


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
    `openai` (chat completions on the episode's URL), `responses` (the Responses API there) or
    `anthropic` (Messages on the run's URL)."""
    made = []

    async def agent(task, base_url):
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

    limits = EpisodeLimits(max_turns=1, max_tokens=spec.max_tokens, max_model_len=engine.config.max_model_len)
    await asyncio.gather(
        *(
            run_agent(agent, AgentEpisode(Prompt(id=f"{tag}-{i}", token_ids=[], messages=m), spec, generate, chat,
                                          limits), server, group_id=tag, index=i, timeout_s=600)
            for i, m in enumerate(conversations)
        )
    )
    return sum(made)


async def main(args: argparse.Namespace) -> None:
    path = resolve_model(args.model)
    engine = VLLMEngine(path, EngineConfig(max_num_seqs=max(args.requests, 16), max_model_len=1024))
    chat = ChatFormat(load_tokenizer(path))
    spec = SamplingSpec(temperature=1.0, max_tokens=args.tokens, ignore_eos=True)
    server = AgentServer(args.model, spec)
    conversations = questions(args.requests)
    http = openai.DefaultAsyncHttpxClient()
    pooled = http_client()
    claude_http = anthropic.DefaultAsyncHttpxClient()
    try:
        await engine.start()
        await server.start()
        await direct(engine, chat, spec, conversations[:4], "warmup")
        await through_endpoint(engine, chat, spec, server, conversations[:4], "warmup", http)
        await through_endpoint(engine, chat, spec, server, conversations[:4], "warmup", claude_http, "anthropic")
        await through_endpoint(engine, chat, spec, server, conversations[:4], "warmup", http, "responses")
        own_clients = await alternate(
            [
                ("rollout() directly", lambda tag: direct(engine, chat, spec, conversations, tag)),
                ("endpoint, a client per episode",
                 lambda tag: through_endpoint(engine, chat, spec, server, conversations, tag)),
            ],
            args.rounds,
        )
        aiohttp_pool = await alternate(
            [
                ("rollout() directly", lambda tag: direct(engine, chat, spec, conversations, tag)),
                ("endpoint, aiohttp pool client",
                 lambda tag: through_endpoint(engine, chat, spec, server, conversations, tag, pooled)),
            ],
            args.rounds,
        )
        responses_api = await alternate(
            [
                ("rollout() directly", lambda tag: direct(engine, chat, spec, conversations, tag)),
                ("Responses API, one HTTP client",
                 lambda tag: through_endpoint(engine, chat, spec, server, conversations, tag, http, "responses")),
            ],
            args.rounds,
        )
        messages_api = await alternate(
            [
                ("rollout() directly", lambda tag: direct(engine, chat, spec, conversations, tag)),
                ("Messages API, one URL",
                 lambda tag: through_endpoint(engine, chat, spec, server, conversations, tag, claude_http,
                                              "anthropic")),
            ],
            args.rounds,
        )
        totals, ratios = await alternate(
            [
                ("rollout() directly", lambda tag: direct(engine, chat, spec, conversations, tag)),
                ("endpoint, one HTTP client",
                 lambda tag: through_endpoint(engine, chat, spec, server, conversations, tag, http)),
            ],
            args.rounds,
        )
    finally:
        await http.aclose()
        await pooled.aclose()
        await claude_http.aclose()
        await server.aclose()
        await engine.aclose()
    report(*own_clients, args, "agent_endpoint_ratio_client_per_episode")
    report(*aiohttp_pool, args, "agent_endpoint_ratio_aiohttp")
    report(*responses_api, args, "responses_ratio")
    report(*messages_api, args, "anthropic_ratio")
    report(totals, ratios, args, "agent_endpoint_ratio")


if __name__ == "__main__":
    asyncio.run(main(engine_args(__doc__, rounds=12)))  # short rounds: more of them for a stable median
