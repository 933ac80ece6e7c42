"""Remote rewards against real aiohttp servers on 127.0.0.1: a server that injects timeouts,
500s, malformed JSON and slow answers, and the reference server in examples/."""

from __future__ import annotations

import asyncio
import importlib.util
import json
from collections import Counter
from pathlib import Path

import pytest
from aiohttp import ClientSession, web

from rollflow.config import RewardConfig, dump_config, load_config
from rollflow.controller import Controller
from rollflow.controller.setup import Given
from rollflow.ledger import summarize
from rollflow.scoring import make_reward
from rollflow.scoring.remote import RemoteReward, RemoteRewardError
from rollflow.testing import FakeEngine, FakeTokenizer, FakeTrainer, NullTransport

TOKEN = "s3cret-token-value"


class FaultyServer:
    """Answers by the mode named in the first prompt: ok, slow, timeout, http500, flaky (500 twice,
    then ok), badjson, http400, short (too few rewards), auth (checks the bearer token)."""

    def __init__(self) -> None:
        self.requests: Counter[str] = Counter()
        self.headers: list[str] = []

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.json()
        mode = body["prompts"][0].split()[0]
        self.requests[mode] += 1
        self.headers.append(request.headers.get("Authorization", ""))
        n = len(body["completions"])
        ok = web.json_response({"rewards": [0.25 * (i % 4) for i in range(n)]})
        if mode == "slow":
            await asyncio.sleep(0.1)
            return ok
        if mode == "timeout":
            await asyncio.sleep(2)
            return ok
        if mode == "http500" or (mode == "flaky" and self.requests[mode] <= 2):
            return web.json_response({"error": "boom"}, status=500)
        if mode == "badjson":
            return web.Response(text="{not json", content_type="application/json")
        if mode == "http400":
            return web.json_response({"error": "bad input"}, status=400)
        if mode == "short":
            return web.json_response({"rewards": [1.0]})
        if mode == "auth" and request.headers.get("Authorization") != f"Bearer {TOKEN}":
            return web.json_response({"error": "no token"}, status=401)
        return ok


async def serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    assert host == "127.0.0.1"
    return runner, f"http://127.0.0.1:{port}"


@pytest.fixture
async def faulty():
    server = FaultyServer()
    app = web.Application()
    app.router.add_post("/score", server.handle)
    runner, base = await serve(app)
    yield server, f"{base}/score"
    await runner.cleanup()


def client(url: str, **kwargs) -> RemoteReward:
    settings = {"timeout_s": 0.5, "max_retries": 2, "backoff_s": 0.01} | kwargs
    return RemoteReward(url, **settings)


async def call(reward: RemoteReward, mode: str, n: int = 4):
    try:
        return await reward([f"{mode} question"] * n, ["c"] * n, answer=["1"] * n)
    finally:
        await reward.aclose()


async def test_retries_happen_only_on_retryable_failures(faulty):
    server, url = faulty
    assert await call(client(url), "ok") == [0.0, 0.25, 0.5, 0.75]
    assert await call(client(url), "slow") == [0.0, 0.25, 0.5, 0.75]  # slow but within the timeout
    assert await call(client(url), "flaky") == [0.0, 0.25, 0.5, 0.75]  # two 500s, then an answer
    failures = {
        "timeout": "no answer within 0.5 s (3 attempts)",
        "http500": "HTTP 500 (3 attempts)",
        "badjson": "the answer is not JSON",
        "http400": "HTTP 400",
        "short": 'expected {"rewards": [4 numbers or nulls]}',
    }
    for mode, reason in failures.items():
        with pytest.raises(RemoteRewardError, match=reason.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
            await call(client(url), mode)
    # Retried: timeouts and 5xx (3 attempts each), the flaky 500s; never a 4xx or a bad answer.
    assert server.requests == Counter(
        ok=1, slow=1, flaky=3, timeout=3, http500=3, badjson=1, http400=1, short=1
    )


async def test_the_bearer_token_comes_from_the_environment_and_stays_out_of_everything(faulty, monkeypatch):
    server, url = faulty
    monkeypatch.setenv("ROLLFLOW_TEST_REWARD_TOKEN", TOKEN)
    config = RewardConfig(name="remote", url=url, token_env="ROLLFLOW_TEST_REWARD_TOKEN", timeout_s=0.5)
    reward = make_reward(config, 0)
    assert await call(reward.func, "auth") == [0.0, 0.25, 0.5, 0.75]
    assert server.headers[-1] == f"Bearer {TOKEN}"
    assert TOKEN not in repr(reward.func)
    written = dump_config(load_config(overrides=[f'scoring.rewards=[{{name="remote", url="{url}", '
                                                 'token_env="ROLLFLOW_TEST_REWARD_TOKEN"}]']))
    assert "ROLLFLOW_TEST_REWARD_TOKEN" in written and TOKEN not in written


async def test_a_run_with_a_failing_reward_server_completes_and_counts_every_failure(faulty, tmp_path):
    server, url = faulty
    modes = ["ok", "timeout", "flaky", "badjson", "http500", "slow"]
    data = tmp_path / "prompts.jsonl"  # the server reads its mode from the prompt
    rows = [json.dumps({"prompt": f"{mode} {i}", "answer": "1"}) for i, mode in enumerate(modes)]
    data.write_text("\n".join(rows) + "\n")
    settings = [
        "sampling.max_tokens=8", "observe.sinks=[]", "run.max_steps=4", "run.groups_per_step=2", "run.max_lag=1",
        "data.task=jsonl", f'data.paths=["{data}"]',
        f'scoring.rewards=[{{name="remote", url="{url}", timeout_s=0.3, max_retries=1, backoff_s=0.01}}]',
    ]
    controller = Controller(
        load_config(preset="tiny", overrides=settings),
        tmp_path / "run",
        given=Given(
            engine=FakeEngine(token_delay=0.001),
            trainer=FakeTrainer(),
            transport=NullTransport(),
            tokenizer=FakeTokenizer(),
        ),
    )
    result = await asyncio.wait_for(controller.run(), 120)
    assert result.steps == 4
    entries = [json.loads(line) for line in (tmp_path / "run" / "ledger.jsonl").read_text().splitlines()]
    dropped = [e["reason"] for e in entries if e["outcome"] == "dropped" and e["reason"].startswith("unscorable")]
    # Every sample of a failing call is unscorable, so its group is dropped with the reason.
    assert any("reward remote: raised RemoteRewardError" in r and "no answer within 0.3 s" in r for r in dropped)
    assert any("HTTP 500 (2 attempts)" in r for r in dropped) and any("not JSON" in r for r in dropped)
    # Trained groups carry the server's rewards 0, 0.25, 0.5, 0.75 (mean 0.375): no failure became a 0.
    assert all(m["rewards"] == {"remote": pytest.approx({"mean": 0.375, "std": 0.2795}, abs=1e-3)}
               for m in result.metrics)
    assert server.requests["flaky"] >= 2 and summarize(tmp_path / "run").duplicates == []


def _reference_app():
    path = Path(__file__).parents[2] / "examples" / "reward_server.py"
    spec = importlib.util.spec_from_file_location("reward_server", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def test_the_reference_server_scores_and_rejects_bad_input_with_a_reason():
    module = _reference_app()
    runner, base = await serve(module.make_app(token=None))
    try:
        async with ClientSession() as session:
            good = {"prompts": ["2+3?"] * 3, "completions": ["it is 5", "6", "no idea"], "answer": ["5"] * 3}
            async with session.post(f"{base}/score", json=good) as resp:
                assert resp.status == 200 and await resp.json() == {"rewards": [1.0, 0.0, None]}
            bad = [
                (b"{oops", "the body is not JSON"),
                (b"[1, 2]", "expected a JSON object"),
                (b'{"prompts": ["a"], "completions": [3]}', "`completions` must be a list of strings"),
                (b'{"prompts": ["a", "b"], "completions": ["x"]}', "2 prompts but 1 completions"),
                (b'{"prompts": ["a"], "completions": ["x"], "answer": 5}', "`answer` must be a list"),
            ]
            for body, reason in bad:
                async with session.post(f"{base}/score", data=body) as resp:
                    assert resp.status == 400 and reason in (await resp.json())["error"]
        reward = RemoteReward(f"{base}/score", timeout_s=2)
        assert await call(reward, "x", 2) == [None, None]  # no number in "c": null, i.e. unscorable
    finally:
        await runner.cleanup()
