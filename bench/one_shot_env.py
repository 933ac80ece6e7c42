"""A verifiers `Env` that plays each task with one agent run and nothing else (what verifiers'
SingleAgentEnv does), for `bench/environments.py`: with `env_id = "one-shot-env"` a plain taskset
goes through verifiers' Env machinery, so the bench measures that path's cost per model call."""

import verifiers.v1 as vf


class OneShotEnv(vf.Env[vf.SingleAgentEnvConfig]):
    async def run(self, task, agents):
        await agents.agent.run(task)


__all__ = ["OneShotEnv"]
