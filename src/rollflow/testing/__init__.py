"""Test doubles that behave: a model-free engine, trainer, weight transport and tokenizer.

They honour the same contracts as the real components (`rollflow.engine.ManagedEngine`,
`rollflow.trainer.TrainerBackend`, `rollflow.weight_sync.WeightTransport`, a Hugging Face
tokenizer's `apply_chat_template` / `decode`) deterministically, so unit tests, the simulator
and the benchmarks can drive the real controller without vLLM or a model. Nothing in a training
run uses them. `greedy_tokens` is the integration tests' reference decoding with transformers; `unused_port`
chooses a port for a server a test starts.
"""

from rollflow.testing.doubles import FakeTokenizer, FakeTrainer, NullTransport
from rollflow.testing.engine import EOS_TOKEN, FakeEngine, context_state, fake_token, mix
from rollflow.testing.ports import unused_port
from rollflow.testing.reference import greedy_tokens

__all__ = [
    "EOS_TOKEN",
    "FakeEngine",
    "FakeTokenizer",
    "FakeTrainer",
    "NullTransport",
    "context_state",
    "fake_token",
    "greedy_tokens",
    "mix",
    "unused_port",
]
