"""One exception hierarchy for rollflow.

Every error rollflow raises derives from `RollflowError`. Two branches matter to callers:
`RetryableError` (a later attempt may succeed: a timeout, a 5xx, a dropped connection) and
everything else, which is fatal and propagates. User mistakes (`UserInputError`: config, data,
model path, CLI) carry a message that names the file, line or field and what was expected; the
CLI prints that message without a traceback and exits with code 2.

This module holds no retry logic; see the retry helper where retries happen.
"""

from __future__ import annotations


class RollflowError(Exception):
    """Base of every error raised by rollflow."""


class RetryableError(RollflowError):
    """A failure a bounded retry may cure (timeouts, transient server errors)."""


class UserInputError(RollflowError):
    """Bad input from the user: the message says where and what was expected."""


class ConfigError(UserInputError):
    """A config file, preset or override that does not match the schema."""


class DataError(UserInputError):
    """A dataset file or row that cannot be read as prompts."""


class ModelNotFoundError(UserInputError):
    """A model reference that names no usable local model."""


class UnusablePrompt(RollflowError):
    """One prompt could not be made (a procedural task's item that raised): the sampler has moved
    past it, and the run drops it with this reason and goes on."""

    def __init__(self, prompt_id: str, reason: str) -> None:
        super().__init__(f"{prompt_id}: {reason}")
        self.prompt_id = prompt_id
        self.reason = reason


class EngineError(RollflowError):
    """The inference engine failed a request or an operation."""


class RequestRefused(EngineError):
    """The engine refused one request (a prompt too long for its context, an empty prompt): that
    request fails; the engine is fine."""


class EngineDeadError(EngineError):
    """The inference engine's process died; the message names what died. Raised from a
    request's stream, it carries what that request had produced (`partial`, an EngineOutput)."""

    def __init__(self, message: str, *, partial: object = None) -> None:
        super().__init__(message)
        self.partial = partial


class WeightSyncError(RollflowError):
    """A weight update did not complete and the engine provably keeps its previous weights and
    label (when that cannot be shown, the engine is taken out of service: `EngineDeadError`)."""


class WeightSyncTimeout(WeightSyncError, RetryableError):
    """A weight update passed its deadline; the message names the stage that stalled."""


class CheckpointError(RollflowError):
    """A checkpoint could not be written or read; the message names it and what was kept."""


class TrainingError(RollflowError):
    """Training cannot go on (e.g. repeated non-finite losses); a checkpoint of the last good
    state has been written when possible."""


class GuestStuckError(RollflowError):
    """Users' calls that never returned hold every thread the guest pool may have
    (`rollflow.guest`); the message names the callable and how many of its calls are stuck."""


class UserCodeExit(RollflowError):
    """User code called `sys.exit()` (or raised `KeyboardInterrupt`) inside a call rollflow made:
    that call's failure, never the process's end. The message says what it did."""
