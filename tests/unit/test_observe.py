"""Metrics, sinks, the trace, plots and the report, against runs whose timing a fake engine sets."""

from __future__ import annotations

import asyncio
import io
import itertools
import json
import re
import time

import pytest

from rollflow.controller import Controller
from rollflow.controller.setup import Given
from rollflow.metrics import ConsoleSink, JsonlSink, LoopLag, TensorBoardSink, flatten, histogram
from rollflow.plots import lag_histogram, plot, report, union
from rollflow.testing import FakeEngine, FakeTokenizer, FakeTrainer, NullTransport
from rollflow.trace import Trace, load_trace

PNG = b"\x89PNG\r\n\x1a\n"


def steady(result):
    return result.metrics[1:]


def mean(values):
    values = list(values)
    return sum(values) / len(values)


@pytest.mark.timeout(60)
async def test_synchronous_run_idles_each_side_for_the_others_share(tmp_path, run_fake):
    # 12 tokens at 10 ms each: ≈ 0.12 s of generation per step, then a 0.12 s trainer step.
    # Synchronous, so each side waits for the other: both idle about half the time.
    engine, trainer = FakeEngine(token_delay=0.01), FakeTrainer(step_s=0.12)
    result, _, _, _ = await run_fake(tmp_path, engine, trainer, max_lag=0, max_steps=6)
    trainer_idle = mean(m["trainer_idle_frac"] for m in steady(result))
    engine_idle = mean(m["engine_idle_frac"] for m in steady(result))
    assert 0.3 < trainer_idle < 0.7, trainer_idle
    assert 0.3 < engine_idle < 0.7, engine_idle
    for m in result.metrics:
        assert m["lag_hist"] == {"0": m["tokens"]} and m["sample_lag_hist"] == {"0": m["samples"]}
        assert m["samples_per_s"] == pytest.approx(m["samples"] / (m["batch_wait_s"] + m["train_step_s"]
                                                                  + m["weight_sync_s"]), rel=0.05)


@pytest.mark.timeout(60)
async def test_asynchronous_run_with_a_slow_trainer_keeps_the_trainer_busy(tmp_path, run_fake):
    # Generation (≈ 12 ms a step) is far faster than training (0.3 s): with max_lag 2 the
    # trainer never waits after the first step, the engine idles most of the time, and the
    # batches are stale by up to 2 versions. (A 0.1 s step left too little room: on a loaded
    # machine the controller's own work per step made the trainer wait 10% of the time.)
    engine, trainer = FakeEngine(token_delay=0.001), FakeTrainer(step_s=0.3)
    result, trainer, _, _ = await run_fake(tmp_path, engine, trainer, max_lag=2, max_steps=6)
    assert mean(m["trainer_idle_frac"] for m in steady(result)) < 0.1
    assert mean(m["engine_idle_frac"] for m in steady(result)) > 0.6
    hist = lag_histogram(result.metrics)
    assert max(hist) == 2 and sum(hist.values()) == sum(m["tokens"] for m in result.metrics)
    for m, batch in zip(result.metrics, trainer.batches, strict=True):
        assert sum(m["lag_hist"].values()) == sum(len(s.logprobs) for s in batch.samples)
        assert sum(m["sample_lag_hist"].values()) == len(batch.samples)


@pytest.mark.timeout(60)
async def test_metrics_count_unscorable_samples_by_reason(tmp_path, tiny_config):
    seen = {"n": 0}

    def half(prompts, completions, **kwargs):  # every third sample has no reward
        out = []
        for _ in completions:
            seen["n"] += 1
            out.append(None if seen["n"] % 3 == 0 else 0.5)
        return out

    controller = Controller(
        tiny_config(max_steps=3),
        tmp_path,
        reward_funcs={"half": half},
        given=Given(engine=FakeEngine(), trainer=FakeTrainer(), transport=NullTransport(), tokenizer=FakeTokenizer()),
    )
    result = await asyncio.wait_for(controller.run(), 60)
    counted = sum(m["unscorable"] for m in result.metrics)
    assert counted > 0
    assert all(m["unscorable_by_reason"] == ({"reward half: returned None": m["unscorable"]}
                                             if m["unscorable"] else {}) for m in result.metrics)
    assert all(m["samples"] + m["unscorable"] == 16 for m in result.metrics)
    assert all(m["rewards"] == {"half": {"mean": 0.5, "std": 0.0}} for m in result.metrics)


def test_flatten_and_histogram():
    assert flatten({"a": 1, "h": {"0": 3, "1": 2}, "s": "text", "b": True}) == {"a": 1.0, "h/0": 3.0, "h/1": 2.0,
                                                                                "b": 1.0}
    assert histogram([2, 0, 2, 1, 2]) == {"0": 1, "1": 1, "2": 3}


def test_console_sink_prints_a_line_per_step_when_not_a_terminal():
    out = io.StringIO()
    sink = ConsoleSink(3, stream=out)
    row = {"step": 0, "reward_mean": 0.25, "lag_mean": 0.5, "lag_max": 1, "trainer_idle_frac": 0.1,
           "engine_idle_frac": 0.2, "gen_tokens_per_s": 900.0, "weight_sync_s": 0.01}
    sink.write(row)
    sink.close()
    assert out.getvalue().startswith("step 1/3  reward 0.250  lag 0.50 (max 1)")


def test_jsonl_sink_appends_and_flushes(tmp_path):
    sink = JsonlSink(tmp_path / "m.jsonl")
    sink.write({"step": 0, "lag_hist": {"0": 4}})
    assert json.loads((tmp_path / "m.jsonl").read_text()) == {"step": 0, "lag_hist": {"0": 4}}
    sink.close()


def test_tensorboard_sink_writes_events_tensorboard_reads(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sink = TensorBoardSink(tmp_path / "tb")
    for step in range(3):
        sink.write({"step": step, "reward_mean": 0.1 * step, "lag_hist": {"0": 5, "1": step}})
    sink.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert {"reward_mean", "lag_hist/0", "lag_hist/1"} <= set(events.Tags()["scalars"])
    assert [(e.step, round(e.value, 6)) for e in events.Scalars("reward_mean")] == [(0, 0.0), (1, 0.1), (2, 0.2)]
    assert [e.value for e in events.Scalars("lag_hist/1")] == [0, 1, 2]


def test_wandb_sink_logs_offline_under_the_run_directory(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from rollflow.metrics import WandbSink

    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")
    sink = WandbSink(tmp_path, project="rollflow-test", mode="offline", config={"run": {"max_lag": 1}})
    for step in range(2):
        sink.write({"step": step, "reward_mean": 0.5, "rewards": {"digits": {"mean": 0.5}}})
    sink.close()
    files = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1
    # The run file holds protobuf records; the logged keys appear in them verbatim. wandb's
    # service process may still be writing them after `finish()` returns.
    deadline = time.monotonic() + 30
    while b"rewards/digits/mean" not in files[0].read_bytes() and time.monotonic() < deadline:
        time.sleep(0.1)
    data = files[0].read_bytes()
    assert b"reward_mean" in data and b"rewards/digits/mean" in data


def test_trace_keeps_the_newest_events_and_writes_trace_event_json(tmp_path):
    trace = Trace(max_events=5, began=100.0)
    lane_a, lane_b, lane_c = trace.lane(), trace.lane(), trace.lane()
    assert (lane_a, lane_b, lane_c) == (0, 1, 2)
    trace.release(lane_c)
    trace.release(lane_a)
    assert trace.lane() == 0  # the lowest free lane is reused
    trace.span("generate", lane_b, 100.0, 100.2, prompt="p")
    for i in range(8):
        trace.span("train step", "trainer", 100.0 + i, 100.5 + i, step=i)
    assert trace.recorded == 9 and trace.dropped == 4
    trace.write(tmp_path / "trace.json")
    data = json.loads((tmp_path / "trace.json").read_text())
    spans = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert [e["args"]["step"] for e in spans] == [3, 4, 5, 6, 7]
    assert spans[0]["ts"] == 3_000_000 and spans[0]["dur"] == 500_000
    assert data["otherData"]["dropped_events"] == 4
    names = {e["tid"]: e["args"]["name"] for e in data["traceEvents"] if e["name"] == "thread_name"}
    assert names[1] == "trainer" and "generate 1" in names.values()
    loaded = load_trace(tmp_path / "trace.json")
    assert loaded["spans"][0]["track"] == "trainer" and loaded["spans"][0]["end"] == pytest.approx(3.5)


def test_load_trace_rejects_other_json(tmp_path):
    (tmp_path / "trace.json").write_text('{"events": []}')
    with pytest.raises(ValueError, match="traceEvents"):
        load_trace(tmp_path / "trace.json")


@pytest.mark.timeout(30)
async def test_loop_lag_sees_a_blocked_loop():
    probe = LoopLag(every_s=0.01)
    task = asyncio.create_task(probe.run())
    await asyncio.sleep(0.05)
    time.sleep(0.2)  # blocks the event loop on purpose
    await asyncio.sleep(0.05)
    task.cancel()
    lag = probe.take()
    assert lag["loop_lag_ms_max"] >= 150
    assert probe.take() == {"loop_lag_ms_mean": 0.0, "loop_lag_ms_max": 0.0}


def test_union_merges_overlapping_intervals():
    assert union([(3, 4), (0, 1), (0.5, 2), (2, 2.5)]) == [(0, 2.5), (3, 4)]


@pytest.mark.timeout(60)
async def test_fake_run_trace_plot_and_report(tmp_path, run_fake):
    engine, trainer = FakeEngine(token_delay=0.002), FakeTrainer(step_s=0.02)
    result, _, _, _ = await run_fake(tmp_path / "run", engine, trainer, max_lag=1, max_steps=4)
    spans = load_trace(tmp_path / "run" / "trace.json")["spans"]
    names = {s["name"] for s in spans}
    assert {"generate", "reward", "train step", "micro-batch", "stage weights", "engine update"} <= names
    steps = [s for s in spans if s["name"] == "train step"]
    assert len(steps) == 4
    for s in spans:
        if s["name"] == "generate":
            assert s["track"].startswith("generate ") and s["args"]["tokens"] > 0
    # Concurrent requests never share a lane.
    by_lane: dict[str, list] = {}
    for s in spans:
        if s["track"].startswith("generate"):
            by_lane.setdefault(s["track"], []).append((s["start"], s["end"]))
    for intervals in by_lane.values():
        intervals.sort()
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(intervals))
    paths = plot([tmp_path / "run"])
    assert {p.name for p in paths} == {"timeline.png", "reward.png", "staleness.png", "staleness_by_cause.png",
                                       "throughput.png"}
    assert all(p.read_bytes().startswith(PNG) and p.stat().st_size > 5_000 for p in paths)
    text = report(tmp_path / "run")
    assert "steps               4 (max_lag 1)" in text or "4 (max_lag 1)" in text
    assert re.search(r"sample lag in flight +0: \d", text) and re.search(r"sample lag in queue +\d: \d", text)
    # In `keep` mode an update lands mid-request: the fake engine's samples mix versions, as real ones do.
    mixed = sum(m["mixed_version_samples"] for m in result.metrics)
    assert mixed > 0 and re.search(rf"samples mixing versions +{mixed}\n", text)
    assert f"{result.trained_prompts} trained" in text and "0 duplicates" in text


async def test_a_run_whose_config_leaves_max_lag_at_its_default_reports_the_default(tmp_path, run_fake):
    """The report reads the run's config through the config loader: a config.toml without
    run.max_lag (a hand-written one, or an older run's) means the default, not "None"."""
    from rollflow.config import RunConfig

    await run_fake(tmp_path / "run", FakeEngine(token_delay=0.001), FakeTrainer(), max_lag=1, max_steps=2)
    (tmp_path / "run" / "config.toml").write_text('[run]\nmax_steps = 2\n')
    assert f"2 (max_lag {RunConfig().max_lag})" in report(tmp_path / "run")


async def test_evaluations_during_training_get_a_chart_and_a_report_line(tmp_path, run_fake):
    await run_fake(tmp_path / "run", FakeEngine(token_delay=0.001), FakeTrainer(), max_lag=1, max_steps=4)
    metrics_file = tmp_path / "run" / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics_file.read_text().splitlines()]
    assert not any("eval_accuracy" in r for r in rows)  # no evaluation configured, no key
    rows[1] |= {"eval_accuracy": 0.25, "eval_pass_at_k": 0.5, "eval_s": 0.1}
    rows[3] |= {"eval_accuracy": 0.75, "eval_s": 0.1}
    metrics_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert "eval.png" in {p.name for p in plot([tmp_path / "run"])}
    assert re.search(r"held-out accuracy +after step 2: 0.250  4: 0.750", report(tmp_path / "run"))


async def test_a_blocked_loop_is_reported_naming_the_code_it_is_stuck_in(caplog):
    probe = LoopLag(every_s=0.01, block_warn_s=0.3)
    task = asyncio.create_task(probe.run())
    await asyncio.sleep(0.05)

    async def reset_that_sleeps():  # an environment's async reset() with a blocking call
        time.sleep(1.2)

    with caplog.at_level("WARNING", logger="rollflow.metrics"):
        await reset_that_sleeps()
        await asyncio.sleep(0.05)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    (record,) = [r for r in caplog.records if "event loop has been blocked" in r.getMessage()]
    assert "in reset_that_sleeps" in record.getMessage() and "asyncio.to_thread" in record.getMessage()


async def test_a_samples_lag_splits_into_its_time_in_flight_and_in_the_queue(tmp_path, run_fake):
    """Per step, every trained sample is counted once in each cause, and its two parts add up to
    its lag: the two histograms' weighted sums are the sample-lag histogram's."""
    # Generation (12 tokens x 10 ms) slower than a step (20 ms): updates land while samples generate.
    engine, trainer = FakeEngine(token_delay=0.01), FakeTrainer(step_s=0.02)
    result, _, _, _ = await run_fake(tmp_path / "run", engine, trainer, max_lag=2, max_steps=6)

    def weighted(hist):
        return sum(int(lag) * n for lag, n in hist.items())

    for m in result.metrics:
        flight, queue, sample = m["lag_in_flight_hist"], m["lag_in_queue_hist"], m["sample_lag_hist"]
        assert sum(flight.values()) == sum(queue.values()) == sum(sample.values()) == m["samples"]
        assert weighted(flight) + weighted(queue) == weighted(sample)
    # With room for two steps in flight, some samples waited in the queue and some saw updates while generating.
    assert any(weighted(m["lag_in_queue_hist"]) for m in result.metrics)
    assert any(weighted(m["lag_in_flight_hist"]) for m in result.metrics)
