"""One agent episode: the OpenAI chat calls of one agent run, recorded token-in/token-out.

The episode keeps a conversation as one token sequence, as `rollflow.envs.run_episode` does: the
opening messages rendered with the chat template, then each model turn's tokens exactly as
sampled (log-probs and per-token versions kept), then what the agent added before its next call
(tool results, user messages) rendered and tokenised on its own (`ChatFormat.extend`), with loss
mask 0.

A call continues the conversation when its messages start with every message of the conversation
so far, the model's replies as they were returned (same text, same tool calls). Anything else (a
message dropped or edited, a reply replaced, the tools changed) rewrites history: the conversation
so far is closed as a segment and the call starts a new one. The episode's sample is its last
conversation, with the earlier ones as its `segments` (trained with the same reward and advantage).
Calls that name a session (`session`, the endpoint's `X-Session-ID`) are kept apart, a `Lane` of
conversations per session, so two agents of one episode never look like rewrites of each other;
the sample is one session's, the others are served and not trained.

A reply's Hermes `<tool_call>` blocks are returned as tool calls; when one of them is broken (not
JSON, no name), none is, and the reply is the turn's whole text, as the model wrote it.

Budgets (`EpisodeLimits`): turns, the sequence's tokens, the model's tokens over the whole episode
and wall time. A call that finds one spent generates nothing and gets an empty reply ending in
`length` (each dialect's own stop reason); a turn that the episode's tokens cut short ends in
`length` too. The first budget that did either is the episode's `Sample.budget`. Stop sequences
are applied to the turn as sampled: it stands up to the token that completes the first one, and
the reply's text ends before it.
This module does not serve HTTP (`rollflow.agent.server`) or run the agent (`rollflow.agent`).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec

from rollflow.agent.messages import BadRequest, canonical, message_key
from rollflow.envs.tools import split_calls
from rollflow.episodes import ChatFormat, EpisodeLimits, GenerateTurn, Recording, Sequence, sample_of
from rollflow.records import Message, Prompt, Sample, SamplingSpec


class Reply(msgspec.Struct, frozen=True, kw_only=True):
    """One call's answer, in the terms of the OpenAI API."""

    content: str | None
    tool_calls: list[dict[str, Any]] = []
    finish_reason: str
    """`stop`, `length` or `tool_calls`."""
    token_ids: list[int] = []
    logprobs: list[float] = []
    prompt_tokens: int = 0
    stop_sequence: str | None = None
    """The stop sequence that ended the turn (its text ends before it)."""


@dataclass(eq=False, kw_only=True)
class Conversation(Sequence):
    """One token sequence of an episode, with the messages it holds."""

    keys: list[Any]
    """The messages it holds as the agent sends them (`message_key`), after the tools' key."""
    canonical: list[Message]
    """The same messages as the chat template renders them."""


BUDGET_SETTINGS = {
    "turns": "max_turns", "tokens": "max_tokens", "model_tokens": "max_model_tokens", "time": "time_budget_s",
}  # fmt: skip
"""Each budget an episode's call can find spent, and the `[env]` setting that sets it."""


@dataclass(eq=False)
class Lane:
    """The calls of one session of an episode (`X-Session-ID`): its conversations and its turns."""

    current: Conversation | None = None
    closed: list[Conversation] = field(default_factory=list)
    """Conversations ended by a history rewrite, oldest first."""
    calls: int = 0
    """Model turns generated."""
    interruptions: int = 0
    """Weight updates its turns were interrupted by."""
    budget: str | None = None
    """The first budget that refused one of its calls or cut its turn short (`BUDGET_SETTINGS`)."""


class AgentEpisode:
    """The calls of one agent run (made one at a time: an episode's calls are serialised)."""

    def __init__(
        self,
        prompt: Prompt,
        sampling: SamplingSpec,
        generate: GenerateTurn,
        chat: ChatFormat,
        limits: EpisodeLimits,
    ) -> None:
        self.prompt = prompt
        self.sampling = sampling
        self.generate = generate
        self.chat = chat
        self.limits = limits
        self.lanes: dict[str | None, Lane] = {None: Lane()}
        """Each session's calls (None: calls that name no session)."""
        self.lane: str | None = None
        """The session of the latest call."""
        self.model_tokens = 0
        """Tokens the model generated in the episode, every sequence of it."""
        self.started = time.monotonic()
        self.ended = False
        """The episode's sample has been taken: later calls are refused and change nothing."""
        self._lock = asyncio.Lock()

    @property
    def current(self) -> Conversation | None:
        """The latest call's conversation."""
        return self.lanes[self.lane].current

    @property
    def budget(self) -> str | None:
        """The budget that refused or cut the latest call's session's calls first, if any."""
        return self.lanes[self.lane].budget

    @property
    def calls(self) -> int:
        """Model turns generated in the latest call's session."""
        return self.lanes[self.lane].calls

    async def complete(
        self,
        messages: Any,
        *,
        tools: list[dict[str, Any]] | None = None,
        max_tokens: int | None = None,
        seed: int | None = None,
        parse_tools: bool = True,
        stop: list[str] | None = None,
        session: str | None = None,
    ) -> Reply:
        """Answer one chat call with the model's next turn (raises `BadRequest`); `session` keeps the
        call's conversation apart from other sessions' (`X-Session-ID`)."""
        if not isinstance(messages, list) or not messages:
            raise BadRequest("expected a non-empty list of messages", "messages")
        keys = [json.dumps(tools or [], sort_keys=True), *(message_key(m, i) for i, m in enumerate(messages))]
        async with self._lock:
            self._refuse_if_ended()
            self.lane = session
            lane = self.lanes.setdefault(session, Lane())
            spent = self._spent(lane)
            if spent is not None:
                return self._out_of(lane, spent)
            conv = self._continue(lane, keys, tools)
            if conv is None:
                return self._out_of(lane, "tokens")
            left, which = self._left(conv)
            asked = min(max_tokens or self.sampling.max_tokens, self.sampling.max_tokens)
            if min(asked, left) <= 0:
                return self._out_of(lane, which)
            # The engine stops at a stop sequence: no token past it is generated, only to be cut.
            spec = msgspec.structs.replace(
                self.sampling, max_tokens=min(asked, left), seed=seed, stop=tuple(stop or ())
            )
            turn = await self.generate(conv.opening + conv.tokens, spec, lane.calls)
            self._refuse_if_ended()  # the episode ended while its turn was generated: the turn is not its
            n, text, matched = self._cut(turn.completion_token_ids, stop or [])
            finish = "stop" if matched is not None else turn.finish_reason
            if finish == "length" and left < asked:  # the episode's budget, not the call's, cut the turn
                lane.budget = lane.budget or which
            lane.calls += 1
            self.model_tokens += n
            lane.interruptions += turn.interruptions
            token_ids, logprobs = turn.completion_token_ids[:n], turn.logprobs[:n]
            conv.add(token_ids, logprobs, turn.versions[:n], 1)
            conv.finish_reason = finish
            raw = self.chat.tokenizer.decode(token_ids, skip_special_tokens=False)
            conv.rendered += raw
            conv.canonical.append(Message(role="assistant", content=self.chat.assistant_content(raw)))
            reply = self._reply(text, token_ids, logprobs, finish, parse_tools, lane.calls - 1)
            returned = {"role": "assistant", "content": reply.content, "tool_calls": reply.tool_calls}
            conv.keys.append(message_key(returned, len(conv.keys)))
            return msgspec.structs.replace(
                reply, prompt_tokens=len(conv.opening) + len(conv.tokens) - n, stop_sequence=matched
            )

    def _spent(self, lane: Lane) -> str | None:
        """The budget that leaves no turn to this call, checked before it (None: there is room)."""
        limits = self.limits
        if lane.calls >= limits.max_turns:
            return "turns"
        if limits.max_model_tokens and self.model_tokens >= limits.max_model_tokens:
            return "model_tokens"
        if limits.time_budget_s and time.monotonic() - self.started >= limits.time_budget_s:
            return "time"
        return None

    def _left(self, conv: Conversation) -> tuple[int, str]:
        """(the tokens the episode leaves this turn, the budget that sets it)."""
        limits = self.limits
        room = min(limits.max_tokens - len(conv.tokens), limits.max_model_len - len(conv.opening) - len(conv.tokens))
        if limits.max_model_tokens and limits.max_model_tokens - self.model_tokens < room:
            return limits.max_model_tokens - self.model_tokens, "model_tokens"
        return room, "tokens"

    def _out_of(self, lane: Lane, budget: str) -> Reply:
        """The answer to a call of `lane` that finds `budget` spent: no turn, the stop reason `length`."""
        lane.budget = lane.budget or budget
        return Reply(content="", finish_reason="length")

    def _cut(self, token_ids: list[int], stop: list[str]) -> tuple[int, str, str | None]:
        """(the turn's tokens that stand, the reply's text, the stop sequence that cut it): with stop
        sequences, the shortest run of tokens whose text holds one, the text ending before it."""

        def text(n: int) -> str:
            return self.chat.tokenizer.decode(token_ids[:n], skip_special_tokens=True)

        def found(n: int) -> str | None:
            t = text(n)
            hits = [(t.find(s), s) for s in stop if s in t]
            return min(hits)[1] if hits else None

        whole = text(len(token_ids))
        if not any(s in whole for s in stop):
            return len(token_ids), whole, None
        lo, hi = 1, len(token_ids)  # a token's text only grows its prefix's: bisect for the first hit
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if found(mid) is not None else (mid + 1, hi)
        matched = found(lo)
        assert matched is not None
        kept = text(lo)
        return lo, kept[: kept.find(matched)], matched

    def _refuse_if_ended(self) -> None:
        if self.ended:
            raise BadRequest("the episode has ended (its agent returned or timed out); this call is not part of it")

    def _continue(self, lane: Lane, keys: list[Any], tools: list[dict[str, Any]] | None) -> Conversation | None:
        """The conversation of `lane` this call extends (its new messages appended as environment
        tokens), or a new one after a history rewrite; None when the new messages leave no room."""
        conv = lane.current
        if conv is not None and len(keys) > len(conv.keys) and keys[: len(conv.keys)] == conv.keys:
            added_keys = keys[len(conv.keys) :]
            messages = conv.canonical + [canonical(k) for k in added_keys]
            try:
                rendered, added = self.chat.extend(conv.rendered, messages, tools)
            except ValueError:  # the template re-renders earlier turns differently: start over
                added = None
            if added is not None:
                limit = min(self.limits.max_tokens, self.limits.max_model_len - len(conv.opening))
                if len(conv.tokens) + len(added) >= limit:
                    return None
                last_version = conv.versions[-1] if conv.versions else 0
                conv.add(added, [0.0] * len(added), [last_version] * len(added), 0)
                conv.keys += added_keys
                conv.canonical, conv.rendered = messages, rendered
                return conv
        messages = [canonical(k) for k in keys[1:]]
        rendered = self.chat.render(messages, tools)
        opening = self.chat.tokens(rendered)
        if len(opening) >= self.limits.max_model_len:
            raise BadRequest(
                f"the conversation is {len(opening)} tokens, no room to generate in engine.max_model_len = "
                f"{self.limits.max_model_len}",
                "messages",
            )
        if conv is not None and conv.tokens:
            lane.closed.append(conv)
        lane.current = Conversation(keys=list(keys), canonical=messages, rendered=rendered, opening=opening)
        return lane.current

    def _reply(
        self, text: str, token_ids: list[int], logprobs: list[float], finish_reason: str, parse_tools: bool, turn: int
    ) -> Reply:
        content, calls = split_calls(text) if parse_tools else (text, [])
        if not calls:
            return Reply(content=content, finish_reason=finish_reason, token_ids=token_ids, logprobs=logprobs)
        tool_calls = [
            {
                "id": f"call_{turn}_{i}",
                "type": "function",
                "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
            }
            for i, c in enumerate(calls)
        ]
        return Reply(
            content=content,
            tool_calls=tool_calls,
            finish_reason="tool_calls" if finish_reason == "stop" else finish_reason,
            token_ids=token_ids,
            logprobs=logprobs,
        )

    @property
    def splits(self) -> int:
        return len(self.lanes[self.lane].closed)

    def sample(
        self, group_id: str, index: int, *, reward: float | None, failure: str | None, session: str | None = None
    ) -> Sample:
        """The episode as one sample: the latest call's session (or `session`), its last
        conversation, earlier ones as segments; `reward` (the agent's) as a process reward at its last
        token. Other sessions' calls are not trained. The episode ends here: the sample holds copies,
        and a call still in flight is refused when its turn comes back."""
        self.ended = True
        lane = self.lanes.get(self.lane if session is None else session) or Lane()
        conv = lane.current
        if conv is None:
            failure = failure or self._no_turn(lane)
        steps = [(len(conv.tokens) - 1, reward)] if conv is not None and conv.tokens and reward is not None else []
        recording = Recording(
            last=conv,
            closed=list(lane.closed),
            interruptions=lane.interruptions,
            failure=failure,
            process_rewards=steps,
            turns=lane.calls,
            budget=lane.budget,
        )
        return sample_of(self.prompt, recording, group_id=group_id, index=index, sampling=self.sampling)

    def _no_turn(self, lane: Lane) -> str:
        """Why an episode has no turn: its agent made no call, or a budget was spent before the first."""
        if lane.budget is None:
            return "agent: made no call to its endpoint"
        setting = BUDGET_SETTINGS[lane.budget]
        value = f"{getattr(self.limits, setting):g}" + (" s" if lane.budget == "time" else "")
        return f"agent: env.{setting} ({value}) was spent before its first turn"
