"""Conversations as token sequences: the model's chat template renders them, and only what an
environment or agent adds is tokenised (the model's own tokens are never re-tokenised). This
module plays no episode (`rollflow.envs.episode`)."""

from __future__ import annotations

from typing import Any

from rollflow.records import Message


class ChatFormat:
    """Renders a conversation with the tokenizer's chat template; tokenises what the environment adds.

    The text rendered so far is kept, so each addition is the difference between the template's
    rendering of the longer conversation and the text already in the sequence: the tokens the
    model produced are never re-tokenised."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.eos_text = tokenizer.eos_token or ""

    def render(self, messages: list[Message], tools: list[dict[str, Any]] | None = None) -> str:
        """The conversation as the model reads it, ready for its next turn (`tools`: OpenAI tool
        definitions, for templates that show them)."""
        extra = {"tools": tools} if tools else {}
        return self.tokenizer.apply_chat_template(
            [{"role": m.role, "content": m.content} for m in messages],
            add_generation_prompt=True,
            tokenize=False,
            **extra,
        )

    def tokens(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def assistant_content(self, turn_text: str) -> str:
        """The message content whose rendering reproduces the model's turn (its end marker dropped)."""
        if self.eos_text and turn_text.endswith(self.eos_text):
            return turn_text[: -len(self.eos_text)]
        return turn_text

    def extend(
        self, rendered: str, messages: list[Message], tools: list[dict[str, Any]] | None = None
    ) -> tuple[str, list[int]]:
        """(the conversation's new rendering, the tokens it adds after `rendered`)."""
        full = self.render(messages, tools)
        if not full.startswith(rendered):
            raise ValueError(
                "the chat template does not render a conversation as an extension of its earlier turns "
                "(it rewrites history), so multi-turn token sequences cannot be built from it"
            )
        return full, self.tokens(full[len(rendered) :])
