"""A verifiers v1 taskset whose package runs its own `Env`: a guessing game in which the game
answers each guess, as TextArena's games and user simulators do. Nothing is downloaded.

The task says the range; the environment keeps the secret (on the task's data), and after each
guess answers "higher" or "lower" as the next user turn, until the guess is right or the player's
turns run out. The environment records the reward on the player's trace: 1 for a solved game,
less for each extra guess. A `referee` agent (the same model, not trained) may comment on the
game after each wrong guess, to show an episode with two agents: rollflow trains only the player.

    [env]
    kind = "verifiers"
    taskset = "guess-taskset"
    taskset_args = {n = 32, high = 8}
"""

import re

import verifiers.v1 as vf


class GuessConfig(vf.TasksetConfig):
    n: int = 32
    """How many games."""
    high: int = 8
    """Secrets are 1..high."""
    referee: bool = False
    """Let the referee agent comment after each wrong guess."""


class GuessData(vf.TaskData):
    secret: int
    high: int
    referee: bool = False


class GuessTask(vf.Task[GuessData, vf.State, vf.TaskConfig]):
    pass


class GuessEnvConfig(vf.EnvConfig):
    player: vf.AgentConfig = vf.AgentConfig(max_turns=4)
    """The player's turns are its guesses."""
    referee: vf.AgentConfig = vf.AgentConfig(max_turns=4)


def first_number(text: str) -> int | None:
    match = re.search(r"-?\d+", text)
    return int(match.group()) if match else None


class GuessEnv(vf.Env[GuessEnvConfig]):
    async def setup(self, agents):
        agents.referee.trainable = False

    async def run(self, task, agents):
        data = task.data
        guesses, solved = 0, False
        async with agents.player.interaction(task) as game:
            segment = await game.turn()
            while not segment.terminated:
                guess = first_number(segment.last_reply)
                guesses += 1
                if guess == data.secret:
                    solved = True
                    break
                hint = "Reply with a number." if guess is None else ("Higher." if guess < data.secret else "Lower.")
                if data.referee:
                    remark = vf.Task(vf.TaskData(idx=data.idx, prompt=f"A player guessed {guess}. Cheer them on."))
                    await agents.referee.run(remark)
                segment = await game.turn(hint)
        game.trace.record_reward("solved", (1.0 / guesses) if solved else 0.0)
        game.trace.record_metric("guesses", float(guesses))


class GuessTaskset(vf.Taskset[GuessTask, GuessConfig]):
    def load(self):
        for i in range(self.config.n):
            secret = (i * 5) % self.config.high + 1
            yield GuessTask(
                GuessData(
                    idx=i,
                    name=f"guess#{i}",
                    prompt=f"I am thinking of a number from 1 to {self.config.high}. Guess it: reply with a number.",
                    system_prompt="You play a guessing game. Reply with one number.",
                    secret=secret,
                    high=self.config.high,
                    referee=self.config.referee,
                ),
                self.config.task,
            )


__all__ = ["GuessEnv", "GuessTaskset"]
