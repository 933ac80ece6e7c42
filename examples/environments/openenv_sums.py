"""An OpenEnv environment, server and client, written the way OpenEnv's own are.

The server side (`SumsEnvironment`, served by `app`) asks "What is a + b?" at reset (the
numbers drawn from the reset seed) and judges each answer: reward 1.0 and done when the reply's
last number is right, otherwise "Not right. Try again." until `MAX_TRIES` answers. The client
(`SumsClient`) is an ordinary `EnvClient`. Serve it with `uvicorn openenv_sums:app` or let
rollflow start it (`[env] kind = "openenv"`, `server = "openenv_sums:app"`).
"""

from __future__ import annotations

import random
import re
from typing import Any

from openenv.core.client_types import StepResult
from openenv.core.env_client import EnvClient
from openenv.core.env_server import Action, Environment, Observation, State, create_app

MAX_TRIES = 2


class SumsAction(Action):
    message: str


class SumsObservation(Observation):
    text: str = ""


class SumsEnvironment(Environment[SumsAction, SumsObservation, State]):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = State()
        self.answer = 0
        self.tries = 0

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> SumsObservation:
        rng = random.Random(seed)
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        self.answer, self.tries = a + b, 0
        self._state = State(episode_id=episode_id, step_count=0)
        return SumsObservation(text=f"What is {a} + {b}?")

    def step(self, action: SumsAction, timeout_s: float | None = None, **kwargs: Any) -> SumsObservation:
        self.tries += 1
        self._state.step_count += 1
        found = re.findall(r"-?\d+", action.message)
        right = bool(found) and int(found[-1]) == self.answer
        if right or self.tries >= MAX_TRIES:
            return SumsObservation(text="", reward=1.0 if right else 0.0, done=True)
        return SumsObservation(text="Not right. Try again.", reward=0.0, done=False)

    @property
    def state(self) -> State:
        return self._state


class SumsClient(EnvClient[SumsAction, SumsObservation, State]):
    def _step_payload(self, action: SumsAction) -> dict[str, Any]:
        return {"message": action.message}

    def _parse_result(self, payload: dict[str, Any]) -> StepResult[SumsObservation]:
        observation = SumsObservation(**payload.get("observation", {}))
        return StepResult(observation=observation, reward=payload.get("reward"), done=bool(payload.get("done")))

    def _parse_state(self, payload: dict[str, Any]) -> State:
        return State(**payload)


app = create_app(SumsEnvironment, SumsAction, SumsObservation, env_name="sums", max_concurrent_envs=64)
