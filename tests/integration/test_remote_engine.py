"""A vLLM server (`serve_command`, as `rollflow serve-engine` runs it) driven over HTTP by
`RemoteEngine`: the same tokens, log-probs and versions as the in-process engine, weight updates,
abort, and a training run whose weights reach the server."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys

import pytest

from rollflow.config import EngineConfig, load_config
from rollflow.controller import Controller
from rollflow.engine import EngineOutput
from rollflow.engine.remote import RemoteEngine
from rollflow.records import Prompt, SamplingSpec
from rollflow.rollout import request_seed
from rollflow.testing import greedy_tokens, unused_port

pytestmark = pytest.mark.integration

PROMPT = [1, 735, 202, 276, 261, 264, 277, 281, 34, 2, 202, 1, 871, 202]
GREEDY = SamplingSpec(temperature=0.0, max_tokens=24, ignore_eos=True)
CONFIG = EngineConfig(kv_cache_bytes=128 * 1024 * 1024, max_model_len=2048, max_num_seqs=16)
LONG = SamplingSpec(temperature=0.0, max_tokens=CONFIG.max_model_len - len(PROMPT) - 8, ignore_eos=True)
"""A stream that an update or an abort must catch mid-way. The tiny model decodes a token in about a
millisecond, so a whole context's worth (2,000 tokens) can finish before a weight update is written,
posted and loaded by a client held off the CPU by other work: the update tests freeze the stream
with `pause(keep=True)` once they have seen its first tokens, and the length is the margin for the
pause's own round trip."""



class Server:
    """A vLLM server subprocess (in its own process group, so a kill takes its engine too), started
    as `rollflow serve-engine` starts one."""

    def __init__(self) -> None:
        port = unused_port()
        # Through the command line, as the README starts one; it execs vLLM's server.
        command = [sys.executable, "-m", "rollflow", "serve-engine", "--preset", "tiny", "--port", str(port),
                   "--set", f"engine.kv_cache_bytes={CONFIG.kv_cache_bytes}",
                   "--set", f"engine.max_model_len={CONFIG.max_model_len}",
                   "--set", f"engine.max_num_seqs={CONFIG.max_num_seqs}"]
        self.url = f"http://127.0.0.1:{port}"
        self.process = subprocess.Popen(
            command,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            # Its own process group, not its own session: with the kernel's autogroup scheduling a
            # session is a CPU group of its own, and on a busy machine vLLM's engine process then
            # starved the server's HTTP process in that group, which sent a 2,000-token stream,
            # and took an abort, only after the engine had decoded all of it.
            process_group=0,
        )

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(30)

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.kill()


class Watched:
    """An engine whose streams count the tokens they have produced so far (a whole-completion
    stream too: it reads deltas and hands back the whole completion at the end, as the engine does)."""

    def __init__(self, engine: RemoteEngine) -> None:
        self.engine = engine
        self.tokens = 0

    def __getattr__(self, name: str):
        return getattr(self.engine, name)

    async def stream(self, request_id, prompt_token_ids, sampling, *, deltas=True):
        tokens: list[int] = []
        logprobs: list[float] = []
        async for out in self.engine.stream(request_id, prompt_token_ids, sampling, deltas=True):
            self.tokens += len(out.token_ids)
            tokens += out.token_ids
            logprobs += out.logprobs
            if deltas:
                yield out
            elif out.finish_reason is not None:
                yield EngineOutput(tokens, logprobs, out.finish_reason, out.versions)


@pytest.fixture(scope="module")
def server():
    first = Server()
    yield first.url
    first.stop()


@pytest.fixture(scope="module")
def second_server():
    """A second server for the pool tests, started once: the gloo test needs it alive, the
    next test kills it mid-run (the test of two nodes starts its own)."""
    second = Server()
    yield second
    second.stop()


@pytest.fixture
async def remote(server, model_a):
    engine = await RemoteEngine(server, CONFIG).start()
    yield engine
    await engine.update_weights(model_a.state_dict())  # leave the server on model A
    await engine.aclose()


@pytest.mark.timeout(300)
async def test_remote_tokens_logprobs_and_versions_equal_the_in_process_engine(remote, plain_engine):
    """The server runs the tiny preset, so the same linear layout (`plain`) as this in-process
    engine: the same kernels, the same numbers."""
    engine = plain_engine
    sampled = SamplingSpec(temperature=0.8, top_k=20, max_tokens=24, ignore_eos=True, seed=7)
    for spec in (GREEDY, sampled):
        here = await engine.generate(PROMPT, spec, f"local-{spec.temperature}")
        there = await remote.generate(PROMPT, spec, f"remote-{spec.temperature}")
        assert there.token_ids == here.token_ids and there.finish_reason == here.finish_reason == "length"
        assert there.logprobs == pytest.approx(here.logprobs, abs=1e-5)
        assert there.versions == [remote.version] * len(there.token_ids)
    # Streamed deltas add up to the same completion.
    tokens = []
    async for out in remote.stream("remote-deltas", PROMPT, GREEDY):
        tokens += out.token_ids
    assert tokens == (await engine.generate(PROMPT, GREEDY, "local-2")).token_ids


@pytest.mark.timeout(300)
async def test_a_stop_sequence_ends_the_request_on_the_server(remote, stop_inside):
    whole = await remote.generate(PROMPT, SamplingSpec(temperature=0.0, max_tokens=48, ignore_eos=True), "whole")
    stop, n = stop_inside(whole.token_ids)
    spec = SamplingSpec(temperature=0.0, max_tokens=48, ignore_eos=True, stop=(stop,))
    out = await remote.generate(PROMPT, spec, "stopped")
    assert n < len(whole.token_ids)
    assert out.token_ids == whole.token_ids[:n] and out.finish_reason == "stop"


@pytest.mark.timeout(300)
async def test_weight_updates_switch_outputs_and_label_every_token(remote, model_a, model_b):
    want_a = model_a.greedy(PROMPT, GREEDY.max_tokens)[0]
    want_b, logp_b = model_b.greedy(PROMPT, GREEDY.max_tokens)
    assert (await remote.generate(PROMPT, GREEDY, "a")).token_ids == want_a
    before = remote.version
    assert await remote.update_weights(model_b.state_dict()) == before + 1
    out = await remote.generate(PROMPT, GREEDY, "b")
    assert out.token_ids == want_b and out.versions == [before + 1] * len(want_b)
    assert out.logprobs == pytest.approx(logp_b, rel=1e-4, abs=1e-4)  # HF sums in another order


@pytest.mark.timeout(300)
async def test_keep_mode_update_mid_stream_switches_versions_at_the_boundary(remote, model_a, model_b):
    seen: list[int] = []
    started = asyncio.Event()

    async def consume():
        async for out in remote.stream("mid", PROMPT, LONG):
            seen.extend(out.token_ids)
            if len(seen) >= 4:
                started.set()
            if out.finish_reason is not None:
                return out

    task = asyncio.create_task(consume())
    await started.wait()
    version = remote.version
    await remote.pause(keep=True)  # hold the stream where it is; the update resumes it
    await remote.update_weights(model_b.state_dict())
    final = await task
    assert version + 1 in final.versions, "the stream finished before the pause landed; make it longer"
    cut = final.versions.index(version + 1)
    assert final.versions == [version] * cut + [version + 1] * (len(seen) - cut) and cut >= 4
    # The tokens before the boundary are model A's, those after are what B makes of that prefix
    # (the last and first few: see the resume test).
    a = min(cut, 64)
    assert seen[cut - a : cut] == model_a.greedy(PROMPT + seen[: cut - a], a)[0]
    assert seen[cut : cut + 8] == model_b.greedy(PROMPT + seen[:cut], 8)[0]


@pytest.mark.timeout(300)
async def test_resume_mode_through_the_server_continues_from_the_prefix(remote, model_a, model_b):
    from rollflow.records import Prompt
    from rollflow.rollout import rollout

    spec = LONG
    n = spec.max_tokens
    version = remote.version
    watched = Watched(remote)
    task = asyncio.create_task(
        rollout(watched, Prompt(id="p", token_ids=PROMPT), spec, group_id="mid-resume", index=0, partial="resume")
    )
    while watched.tokens < 4 and not task.done():
        await asyncio.sleep(0.002)
    await remote.pause(keep=True)  # hold the stream where it is
    assert not task.done(), "the stream finished before the pause; make it longer"
    await remote.update_weights(model_b.state_dict(), partial="resume")  # the server aborts in-flight requests
    sample = await task
    tokens, versions = sample.completion_token_ids, sample.versions
    assert len(tokens) == n and sample.interruptions == 1
    k = versions.index(version + 1)
    assert 0 < k < n and versions == [version] * k + [version + 1] * (n - k)
    # The first tokens on each side of the boundary (greedy decoding of a random model meets
    # near-ties that float summation order may break either way over thousands of tokens).
    a = min(k, 64)
    assert tokens[k - a : k] == model_a.greedy(PROMPT + tokens[: k - a], a)[0]
    want_b, logp_b = model_b.greedy(PROMPT + tokens[:k], min(n - k, 64))
    b = len(want_b)
    assert tokens[k : k + b] == want_b and sample.logprobs[k : k + b] == pytest.approx(logp_b, rel=1e-4, abs=1e-4)


@pytest.mark.timeout(120)
async def test_abort_and_cancel_end_the_request_on_the_server(remote):
    tokens: list[int] = []
    chunks: list[int] = []
    reason = None
    async for out in remote.stream("to-abort", PROMPT, LONG):
        tokens += out.token_ids
        chunks.append(len(out.token_ids))
        if len(tokens) >= 3 and remote.num_live and "to-abort" not in remote._aborted:
            await remote.abort("to-abort")
        reason = out.finish_reason or reason
    assert reason == "abort" and len(tokens) < LONG.max_tokens, f"ended {reason!r} in chunks of {chunks[:8]}..."
    assert remote.num_live == 0


@pytest.mark.timeout(600)
async def test_a_training_run_generates_on_the_server_and_its_weights_reach_it(server, tmp_path, model_a):
    config = load_config(
        preset="tiny", overrides=[f'engine.urls=["{server}"]', "run.max_steps=3", "observe.sinks=[]"]
    )
    controller = Controller(config, tmp_path)
    result = await controller.run()
    assert result.steps == 3 and all(m["tokens"] > 0 for m in result.metrics)
    async with RemoteEngine(server, CONFIG) as check:
        out = await check.generate(PROMPT, SamplingSpec(temperature=0.0, max_tokens=12, ignore_eos=True), "check")
        assert out.token_ids == greedy_tokens(controller.trainer.lm.eval(), PROMPT, 12)
        assert out.token_ids != model_a.greedy(PROMPT, 12)[0]  # the server holds the trained weights
        await check.update_weights(model_a.state_dict())


@pytest.mark.timeout(900)
async def test_weights_reach_every_server_of_a_pool_over_gloo(server, second_server, tmp_path, model_a):
    second = second_server
    config = load_config(
        preset="tiny",
        overrides=[f'engine.urls=["{server}", "{second.url}"]', "run.weight_transport=gloo",
                   "run.max_steps=3", "observe.sinks=[]"],
    )
    controller = Controller(config, tmp_path)
    result = await controller.run()
    assert result.steps == 3 and len(controller.engine.members) == 2
    want = greedy_tokens(controller.trainer.lm.eval(), PROMPT, 12)
    assert want != model_a.greedy(PROMPT, 12)[0]
    spec = SamplingSpec(temperature=0.0, max_tokens=12, ignore_eos=True)
    for url in (server, second.url):
        async with RemoteEngine(url, CONFIG) as check:
            assert (await check.generate(PROMPT, spec, "gloo-check")).token_ids == want, url
            await check.update_weights(model_a.state_dict())


@pytest.mark.timeout(300)
async def test_a_group_decoded_on_two_servers_draws_as_on_one(server, second_server):
    """Runs before the second server is killed. With the seed each sample carries
    (`request_seed`, which the producer gives every request), sample i of a group is the same
    tokens whichever server decodes it, and no two samples of the group repeat each other's draws."""
    prompt = Prompt(id="arithmetic-0-7", token_ids=PROMPT)
    specs = [SamplingSpec(temperature=1.0, max_tokens=16, ignore_eos=True, seed=request_seed(0, prompt.id, "g0", i))
             for i in range(4)]  # fmt: skip
    async with RemoteEngine(server, CONFIG) as a, RemoteEngine(second_server.url, CONFIG) as b:
        on_a = [await a.generate(PROMPT, spec, f"a-{i}") for i, spec in enumerate(specs)]
        on_b = await asyncio.gather(*(b.generate(PROMPT, spec, f"b-{i}") for i, spec in enumerate(specs)))
    assert [o.token_ids for o in on_a] == [o.token_ids for o in on_b]  # in turn on one, at once on the other
    assert len({tuple(o.token_ids) for o in on_a}) == len(specs)


@pytest.mark.timeout(900)
async def test_a_pool_of_two_servers_survives_losing_one(server, second_server, tmp_path, model_a):
    """Runs after the gloo test: it kills the second server they share."""
    from rollflow.ledger import summarize

    second = second_server
    config = load_config(
        preset="tiny",
        overrides=[f'engine.urls=["{server}", "{second.url}"]', "run.max_steps=6", "observe.sinks=[]"],
    )

    def kill_second(row):
        if row["step"] == 1:
            second.kill()  # mid-run: requests are streaming on both servers

    controller = Controller(config, tmp_path, on_step=kill_second)
    result = await controller.run()
    assert result.steps == 6 and controller.engine_restarts == 0
    pool = controller.engine
    assert [m.url for m in pool.members] == [server] and len(pool.taken_out) == 1
    summary = summarize(tmp_path)
    assert summary.ok and summary.duplicates == [] and summary.missing == []
    assert all(m["loss_lag_max"] <= 1 for m in result.metrics)
    # The survivor holds the trained weights (greedy equals transformers on them).
    async with RemoteEngine(server, CONFIG) as check:
        spec = SamplingSpec(temperature=0.0, max_tokens=12, ignore_eos=True)
        out = await check.generate(PROMPT, spec, "pool-check")
        assert out.token_ids == greedy_tokens(controller.trainer.lm.eval(), PROMPT, 12)
        await check.update_weights(model_a.state_dict())


@pytest.mark.timeout(900)
def test_two_nodes_of_trainer_ranks_and_two_servers_one_killed_mid_run(server, tmp_path, model_a):
    """The multi-node recipe on one machine: two torchrun "nodes" of one gloo rank each (rank 0
    runs the controller), two vLLM servers in a pool; the second server is killed after step 1."""
    import json
    import time

    from rollflow.ledger import summarize

    second = Server()
    port = unused_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    common = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
              "--master-addr", "127.0.0.1", "--master-port", str(port)]
    train = ["-m", "rollflow", "train", "--preset", "tiny", "--max-steps", "6", "--output-dir", str(tmp_path),
             "--set", f'engine.urls=["{server}", "{second.url}"]', "--set", "observe.sinks=[]"]
    nodes = [
        subprocess.Popen([*common, "--node-rank", str(rank), *train], env=env, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        for rank in (0, 1)
    ]
    try:
        metrics = tmp_path / "metrics.jsonl"
        deadline = time.monotonic() + 600
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
            assert time.monotonic() < deadline and nodes[0].poll() is None, "the run did not reach step 2"
            time.sleep(0.5)
        second.kill()
        outputs = [node.communicate(timeout=600)[0] for node in nodes]
        codes = [node.returncode for node in nodes]
        tails = [f"node {rank} exited {codes[rank]}:\n{out[-3000:]}" for rank, out in enumerate(outputs)]
        assert codes == [0, 0], "\n".join(tails)
    finally:
        second.stop()
        for node in nodes:
            if node.poll() is None:
                node.kill()
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(6)) and all(r["loss_lag_max"] <= 1 for r in rows)
    assert "taken out of the pool" in outputs[0]
    summary = summarize(tmp_path)
    assert summary.ok and summary.missing == [] and summary.duplicates == []
    # The surviving server serves trained weights, no longer the initial model's.
    async def greedy() -> list[int]:
        async with RemoteEngine(server, CONFIG) as check:
            spec = SamplingSpec(temperature=0.0, max_tokens=12, ignore_eos=True)
            tokens = (await check.generate(PROMPT, spec, "nodes-check")).token_ids
            await check.update_weights(model_a.state_dict())
            return tokens

    assert asyncio.run(greedy()) != model_a.greedy(PROMPT, 12)[0]
