"""Test doubles that behave: a model-free engine, trainer, weight transport and tokenizer.

They honour the same contracts as the real components (`rollflow.engine.ManagedEngine`,
`rollflow.trainer.TrainerBackend`, `rollflow.weight_sync.WeightTransport`, a Hugging Face
tokenizer's `apply_chat_template` / `decode`) deterministically, so unit tests, the simulator
and the benchmarks can drive the real controller without vLLM or a model. Nothing in a training
run uses them. `ScriptedTurns` plays an episode's model turns from a script; `lend` gives one
started engine to several runs in turn; `greedy_tokens` is the integration tests' reference
decoding with transformers; `unused_port` chooses a port for a server a test starts;
`engine_processes` finds vLLM's engine processes.
"""

from rollflow.testing.doubles import FakeTokenizer, FakeTrainer, NullTransport
from rollflow.testing.engine import EOS_TOKEN, FakeEngine, context_state, fake_token, mix
from rollflow.testing.lent import LentEngine, lend
from rollflow.testing.ports import unused_port
from rollflow.testing.processes import alive, engine_processes
from rollflow.testing.reference import greedy_tokens
from rollflow.testing.turns import ScriptedTurns

__all__ = [
    "EOS_TOKEN",
    "FakeEngine",
    "FakeTokenizer",
    "FakeTrainer",
    "LentEngine",
    "NullTransport",
    "ScriptedTurns",
    "alive",
    "context_state",
    "engine_processes",
    "fake_token",
    "greedy_tokens",
    "lend",
    "mix",
    "unused_port",
]
