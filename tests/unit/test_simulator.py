"""The simulator: virtual time, the continuous-batching model, lengths, and the real controller on both clocks."""

from __future__ import annotations

import asyncio
import json
import re
import statistics
import time
from collections import Counter
from dataclasses import replace

import pytest

from rollflow.cli import main
from rollflow.config import load_config
from rollflow.controller import Controller
from rollflow.controller.setup import Given
from rollflow.records import SamplingSpec
from rollflow.sim import Scenario, simulate
from rollflow.sim.calibrate import admission_lag, summary
from rollflow.sim.components import EngineProfile, SimEngine, SimTrainer, SimTransport, TrainerProfile
from rollflow.sim.lengths import LengthModel
from rollflow.sim.loop import run_virtual
from rollflow.sim.profiles import engine_profile, trainer_profile
from rollflow.testing import FakeEngine, FakeTokenizer

FAST_ENGINE = EngineProfile(fixed_s=0.02, per_seq_s=0.001, max_num_seqs=64)
FAST_TRAINER = TrainerProfile(s_per_token=1e-4, fixed_s=0.1, weight_bytes=10**9, sync_bytes_per_s=10e9)


def test_virtual_loop_jumps_over_sleeps():
    async def main_():
        loop = asyncio.get_running_loop()
        order = []

        async def nap(seconds):
            await asyncio.sleep(seconds)
            order.append((seconds, loop.time()))

        await asyncio.gather(nap(3600), nap(2.5), nap(60))
        return order

    began = time.monotonic()
    assert run_virtual(main_()) == [(2.5, 2.5), (60, 60.0), (3600, 3600.0)]
    assert time.monotonic() - began < 1.0


def _stream_all(engine, requests, max_tokens):
    async def one(request_id):
        async for out in engine.stream(request_id, [1, 2, 3], SamplingSpec(max_tokens=max_tokens), deltas=False):
            if out.finish_reason is not None:
                return asyncio.get_running_loop().time()
        raise AssertionError("no final output")

    async def main_():
        await engine.start()
        try:
            return await asyncio.gather(*(one(r) for r in requests))
        finally:
            await engine.aclose()

    return run_virtual(main_())


def test_sim_engine_batches_up_to_max_num_seqs_and_queues_the_rest():
    lengths = LengthModel(empirical=[10])
    profile = EngineProfile(fixed_s=1.0, per_seq_s=0.0, max_num_seqs=2)
    done = _stream_all(SimEngine(profile, lengths), ["g0/0", "g0/1", "g1/0", "g1/1"], max_tokens=100)
    # 10 tokens + the EOS step: the first two finish after 11 steps, the queued two 11 steps later.
    assert done == [11.0, 11.0, 22.0, 22.0]
    wide = EngineProfile(fixed_s=1.0, per_seq_s=0.0, max_num_seqs=4)
    assert _stream_all(SimEngine(wide, lengths), ["g0/0", "g0/1", "g1/0", "g1/1"], max_tokens=100) == [11.0] * 4
    # Replicas split the requests; a bigger batch costs more per step.
    per_seq = EngineProfile(fixed_s=0.0, per_seq_s=1.0, max_num_seqs=4)
    one_replica = _stream_all(SimEngine(per_seq, lengths), ["g0/0", "g0/1", "g1/0", "g1/1"], max_tokens=100)
    two_replicas = _stream_all(SimEngine(per_seq, lengths, replicas=2), ["g0/0", "g0/1", "g1/0", "g1/1"], 100)
    assert one_replica == [44.0] * 4 and two_replicas == [22.0] * 4


def test_length_model_mean_correlation_and_empirical(tmp_path):
    model = LengthModel(mean=300, sigma=0.8, rho=0.0, seed=1)
    draws = [model.length(f"g{i}/0") for i in range(4000)]
    assert statistics.mean(draws) == pytest.approx(300, rel=0.08)
    tied = LengthModel(mean=300, sigma=0.8, rho=1.0)
    assert len({tied.length(f"g7/{i}") for i in range(8)}) == 1  # rho 1: the prompt decides the length
    assert tied.length("g7/3#2") == tied.length("g7/3")  # a resubmission is the same sample
    (tmp_path / "lengths.txt").write_text("5\n7\n\n9\n")
    empirical = LengthModel.parse(str(tmp_path / "lengths.txt"))
    assert {empirical.length(f"g{i}/0") for i in range(200)} == {5, 7, 9}
    ledger = tmp_path / "ledger.jsonl"
    ledger.write_text('{"id":"a","outcome":"trained","step":0,"tokens":[3,4]}\n{"id":"b","outcome":"dropped"}\n')
    assert {LengthModel.parse(str(ledger)).length(f"g{i}/0") for i in range(200)} == {3, 4}
    (tmp_path / "bad.txt").write_text("5\nseven\n")
    with pytest.raises(ValueError, match=r"bad.txt:2: expected a whole number"):
        LengthModel.parse(str(tmp_path / "bad.txt"))
    with pytest.raises(ValueError, match="lognormal:MEAN,SIGMA"):
        LengthModel.parse("lognormal:300")


def _decisions(directory):
    """What the controller decided: each prompt's start version and trained step, each step's lags."""
    trace = json.loads((directory / "trace.json").read_text())
    started = {}
    for e in trace["traceEvents"]:
        if e.get("name") == "generate":
            prompt = e["args"]["prompt"]
            started[prompt] = min(started.get(prompt, 99), e["args"]["version_start"])
    ledger = [json.loads(line) for line in (directory / "ledger.jsonl").read_text().splitlines()]
    trained = Counter((e["step"], started[e["id"]]) for e in ledger if e["outcome"] == "trained")
    metrics = [json.loads(line) for line in (directory / "metrics.jsonl").read_text().splitlines()]
    return started, trained, [(m["lag_hist"], m["samples"], m["withheld_tokens"]) for m in metrics]


def _controller(output_dir, clock):
    config = load_config(
        preset="tiny",
        overrides=["run.max_lag=1", "run.max_steps=5", "run.groups_per_step=2", "rollout.group_size=2",
                   "sampling.max_tokens=5", "observe.sinks=[]", "checkpoint.enabled=false"],
    )
    trainer_profile = TrainerProfile(s_per_token=0.0, fixed_s=0.15, sync_fixed_s=0.02)
    return Controller(
        config,
        output_dir,
        given=Given(
            engine=FakeEngine(token_delay=0.01),
            runner=SimTrainer(trainer_profile),
            transport=SimTransport(trainer_profile),
            tokenizer=FakeTokenizer(prompt_tokens=16),
            clock=clock,
        ),
    )


@pytest.mark.timeout(60)
def test_same_scenario_on_real_and_virtual_time_makes_the_same_decisions(tmp_path):
    """The simulator is the controller itself: the same components on the real clock and on the
    virtual one start the same prompts at the same versions and train them at the same steps."""

    async def real():
        await _controller(tmp_path / "real", time.monotonic).run()

    async def virtual():
        await _controller(tmp_path / "virtual", asyncio.get_running_loop().time).run()

    began = time.monotonic()
    asyncio.run(real())
    real_s = time.monotonic() - began
    began = time.monotonic()
    run_virtual(virtual())
    virtual_s = time.monotonic() - began
    assert _decisions(tmp_path / "real") == _decisions(tmp_path / "virtual")
    assert virtual_s < real_s / 3  # the virtual run does not sleep
    started, trained, _ = _decisions(tmp_path / "virtual")
    assert max(started.values()) >= 2 and sum(trained.values()) == 10


def test_simulated_runs_follow_the_expected_shape():
    base = Scenario(engine=FAST_ENGINE, trainer=FAST_TRAINER, steps=6, groups_per_step=4, group_size=4,
                    prompt_tokens=64, max_tokens=64, lengths=LengthModel(mean=40, sigma=0.5))
    sync, lag1 = simulate(replace(base, max_lag=0)), simulate(base)
    assert set(sync.lag_hist) == {0} and sync.wasted_tokens == 0
    # Long samples can outlive the bound (they are consumed after shorter, later ones); their
    # stale tokens are withheld, so the loss never sees a lag above max_lag.
    assert all(m["loss_lag_max"] <= 1 for m in lag1.metrics)
    assert lag1.withheld_tokens == sum(count for lag, count in lag1.lag_hist.items() if lag > 1)
    assert lag1.steps_per_hour > sync.steps_per_hour  # overlap pays
    restart = simulate(replace(base, partial="restart"))
    assert restart.preempted_tokens > 0 and restart.wasted_tokens == restart.withheld_tokens + restart.preempted_tokens


def test_simulate_command_prints_a_row_and_rejects_bad_sweeps(capsys, tmp_path):
    assert main(["simulate", "--steps", "3", "--groups", "4", "--group-size", "2", "--max-tokens", "64",
                 "--sweep", "inference-gpus=1,2", "--plot", str(tmp_path / "sweep.png")]) == 0
    out = capsys.readouterr().out
    assert "inference-gpus=1" in out and "inference-gpus=2" in out
    assert (tmp_path / "sweep.png").read_bytes()[:4] == b"\x89PNG"
    assert main(["simulate", "--sweep", "gpus=1,2"]) == 2
    assert "expected NAME=V1,V2" in capsys.readouterr().err
    assert main(["simulate", "--lengths", str(tmp_path / "missing.txt")]) == 2


def test_an_engine_elsewhere_sent_only_the_changes_loads_that_share_of_the_bytes():
    """A 7B model's 15 GB over a 1 GB/s link, every byte each update against the changed 2 %
    after the first: each load's time is its bytes over the link, and a sync-bound run speeds up."""
    link = replace(trainer_profile("7B"), sync_bytes_per_s=1e9, sync_fixed_s=0.0, snapshots=True)
    delta = replace(link, delta_fraction=0.02, delta_scan_bytes_per_s=60e9)
    base = Scenario(engine=engine_profile("7B"), trainer=link, steps=5, groups_per_step=4, group_size=4,
                    prompt_tokens=64, max_tokens=64, lengths=LengthModel(mean=40, sigma=0.5))
    full, changed = simulate(base), simulate(replace(base, trainer=delta))
    every = link.weight_bytes
    loads = [m["engine_update_s"] for m in changed.metrics[1:]]  # a step reports the load before it
    assert abs(loads[0] - every / 1e9) <= 0.01 * loads[0]  # the first load has no base: every byte
    per_delta = every * 0.02 / 1e9 + every / 60e9  # the changes over the link, after a scan of all
    assert all(abs(s - per_delta) <= 0.01 * per_delta for s in loads[1:]), (loads, per_delta)
    assert all(abs(m["engine_update_s"] - every / 1e9) <= 0.01 * every / 1e9 for m in full.metrics[1:])
    assert changed.steps_per_hour > 2 * full.steps_per_hour


@pytest.mark.parametrize("max_lag", [1, 2, 3])
def test_the_simulated_lag_is_the_admission_rules_closed_form_and_splits_by_the_slower_side(max_lag):
    """Every sample starts as soon as the admission rule lets it, so its lag is min(step, max_lag)
    whichever side is slower; a slow trainer leaves it in the queue, a slow engine in flight."""
    engine = EngineProfile(fixed_s=0.0015, per_seq_s=0.00006)
    lags = {}
    for side, s_per_token in (("trainer", 60e-6), ("engine", 2e-6)):
        scenario = Scenario(engine=engine, trainer=TrainerProfile(s_per_token=s_per_token, layout="padded"),
                            lengths=LengthModel(mean=48, sigma=0.3), max_lag=max_lag, steps=30, groups_per_step=4,
                            group_size=4, prompt_tokens=100, max_tokens=64)
        lags[side] = summary(simulate(scenario).metrics)
    closed = admission_lag(max_lag, 30)
    for side, m in lags.items():
        assert abs(m["lag_in_flight"] + m["lag_in_queue"] - closed) <= 0.06 * max_lag, (side, m, closed)
    assert lags["trainer"]["trainer_idle"] < 0.05 < 0.5 < lags["engine"]["trainer_idle"]
    assert lags["trainer"]["lag_in_queue"] >= 0.95 * closed  # generated at once, then waiting
    assert lags["engine"]["lag_in_flight"] > lags["engine"]["lag_in_queue"]  # the policy moves while it generates
    assert admission_lag(2, 24) == pytest.approx((1 + 22 * 2) / 23) and admission_lag(0, 5) == 0.0


def test_simulate_takes_the_links_bandwidth_and_the_changed_share(capsys):
    args = ["simulate", "--steps", "2", "--groups", "2", "--group-size", "2"]
    assert main([*args, "--sync-gb-per-s", "1", "--delta-fraction", "0.015"]) == 0
    assert "weight sync 1 GB/s, after the first update 0.015 of the bytes" in capsys.readouterr().out
    assert main([*args, "--delta-fraction", "0"]) == 2
    assert "--delta-fraction: expected a share of the bytes in (0, 1], got 0.0" in capsys.readouterr().err
    assert main([*args, "--sync-gb-per-s", "-1"]) == 2


def test_the_default_scenario_simulates(capsys):
    """The defaults (a 1,024-token budget after 256-token prompts) are a context no tiny-preset
    engine setting allows: the simulated run gets a context that fits its scenario."""
    assert main(["simulate", "--steps", "2", "--groups", "2", "--group-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "result" in out and "confidence: planning profile" in out


TRUE_FIXED_S, TRUE_PER_TOKEN_S = 0.05, 60e-6
"""The ground truth's trainer: a step costs this plus this per token of the tensors it lays out."""
TRUE_STEPS = ((1, 0.002), (8, 0.003), (16, 0.0045), (32, 0.0052))
"""The ground truth's engine: decode step seconds by batch size (not a line)."""


class LaidOutTrainer(SimTrainer):
    """Ground truth for the calibration replay: a step costs what the trainer's own code puts
    through the model, the tokens of the tensors `pad` lays out for each micro-batch of the plan
    (not the simulator's `model_tokens` count of them)."""

    def step_s(self, batch):
        import torch

        from rollflow.trainer.batches import pad, plan_micro_batches

        p, samples = self.profile, batch.samples
        plan = plan_micro_batches(samples, list(range(len(samples))), p.micro_batch_tokens, p.layout)
        tokens = sum(pad([samples[i] for i in micro], torch.device("cpu"), p.layout)["tokens"] for micro in plan)
        return TRUE_FIXED_S + tokens * TRUE_PER_TOKEN_S


def test_a_calibration_replays_its_run_and_predicts_another(monkeypatch):
    """What bench/simulator_validation.py does on the CPU, on ground truths whose costs are known:
    fit the profiles to a synchronous run, replay it, predict a run of other group sizes. A change
    that makes the simulated trainer's cost stop following the layout's model tokens (as when
    shared prompts became the default) breaks the prediction here."""
    import rollflow.sim as sim
    from rollflow.sim.calibrate import engine_profile, errors, fit_to_run, summary, trainer_profile

    lengths = LengthModel(mean=48, sigma=0.6, seed=3)
    truth = EngineProfile(fixed_s=0.0, per_seq_s=0.0, step_table=TRUE_STEPS, prefill_per_token_s=2e-6,
                          max_num_seqs=64)

    def scenario(engine, trainer, max_lag, groups, group_size):
        return Scenario(engine=engine, trainer=trainer, lengths=lengths, max_lag=max_lag, steps=12,
                        groups_per_step=groups, group_size=group_size, prompt_tokens=200, max_tokens=96)

    with monkeypatch.context() as patched:  # the "real" runs: the ground truth's trainer
        patched.setattr(sim, "SimTrainer", LaidOutTrainer)
        placeholder = TrainerProfile(s_per_token=0.0, weight_bytes=10**6, sync_bytes_per_s=1e9)
        real_a = simulate(scenario(truth, placeholder, 0, 8, 4)).metrics
        real_b = simulate(scenario(truth, placeholder, 2, 2, 16)).metrics

    # A microbenchmark's level is off by 30% (a busier minute); the run sets it right.
    measured = engine_profile({b: s * 1.3 for b, s in TRUE_STEPS}, prefill_per_token_s=2.6e-6, max_num_seqs=64)
    trainer = trainer_profile(real_a, layout="shared_prompt", micro_batch_tokens=4096)
    assert trainer.s_per_token == pytest.approx(TRUE_PER_TOKEN_S, rel=0.05)
    engine, trainer = fit_to_run(
        measured, trainer, lambda e, t: simulate(scenario(e, t, 0, 8, 4)).metrics, real_a
    )
    replay = errors(summary(simulate(scenario(engine, trainer, 0, 8, 4)).metrics), summary(real_a))
    predicted = errors(summary(simulate(scenario(engine, trainer, 2, 2, 16)).metrics), summary(real_b))
    assert abs(replay["steps_per_s_pct"]) < 2 and abs(replay["trainer_idle_pts"]) < 1, replay
    assert abs(predicted["steps_per_s_pct"]) < 3 and abs(predicted["trainer_idle_pts"]) < 2, predicted


def test_a_measured_step_table_is_interpolated_and_extended_along_its_ends():
    profile = EngineProfile(fixed_s=9.0, per_seq_s=9.0, step_table=((4, 0.002), (16, 0.003), (32, 0.006)))
    assert profile.decode_s(4) == pytest.approx(0.002) and profile.decode_s(32) == pytest.approx(0.006)
    assert profile.decode_s(10) == pytest.approx(0.0025)  # between the measured sizes
    assert profile.decode_s(24) == pytest.approx(0.0045)
    assert profile.decode_s(48) == pytest.approx(0.009)  # beyond: along the last segment
    assert profile.decode_s(1) == pytest.approx(0.00175)
    assert EngineProfile(fixed_s=0.01, per_seq_s=0.001).decode_s(10) == pytest.approx(0.02)  # no table: the line
    assert profile.step_s(16, context_tokens=100, prefill_tokens=0) == pytest.approx(0.003)


def test_a_saved_calibration_loads_and_simulate_says_how_far_to_trust_it(tmp_path, capsys):
    from rollflow.sim.calibrate import Calibration

    calibration = Calibration(
        engine=EngineProfile(fixed_s=0.002, per_seq_s=1e-4, step_table=((1, 0.002), (32, 0.005))),
        trainer=TrainerProfile(s_per_token=8e-5, weight_bytes=2 * 10**6, stage_bytes_per_s=1e9, sync_bytes_per_s=1e9),
        lengths=[20, 30, 40, 64], prompt_tokens=119, machine="a test machine",
        replay={"steps_per_s_pct": 0.2, "trainer_idle_pts": -0.1},
        predicted={"steps_per_s_pct": -5.2, "trainer_idle_pts": 1.1},
    )
    calibration.save(tmp_path / "profile.json")
    assert Calibration.load(tmp_path / "profile.json") == calibration
    assert main(["simulate", "--profile", str(tmp_path / "profile.json"), "--steps", "3", "--groups", "2",
                 "--group-size", "4", "--prompt-tokens", "119", "--max-tokens", "64"]) == 0
    out = capsys.readouterr().out
    assert ("confidence: calibrated on a test machine: reproduced its calibration run within 0.2% steps/s, "
            "0.1 points trainer idle; another configuration within 5.2% steps/s, 1.1 points trainer idle") in out
    (tmp_path / "bad.json").write_text("{}")
    assert main(["simulate", "--profile", str(tmp_path / "bad.json")]) == 2
    assert "not a calibration saved by bench/simulator_validation.py" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (lambda d: d["engine"].update(fixed_s="0.002"), r"engine.fixed_s: expected `float`, got `str`"),
        (lambda d: d["engine"].update(step_table=[[1, 0.0], [32, 0.0]], fixed_s=0.0, per_seq_s=0.0),
         r"engine.step_table\[0\]: .*and a positive time"),
        (lambda d: d["trainer"].update(s_per_token=-1.0), r"trainer.s_per_token: expected 0 or more, got -1"),
        (lambda d: d["trainer"].update(s_per_token=0.0, fixed_s=0.0),
         r"trainer: a step takes no time \(s_per_token and fixed_s are 0\)"),
        (lambda d: d.update(lengths=[20, "thirty"]), r"lengths\[1\]: expected `int`, got `str`"),
        (lambda d: d["engine"].update(step_table=[[1, 0.002, 7]]),
         r"engine.step_table\[0\]: expected `array` of length 2"),
    ],
    ids=["string-time", "zero-step-table", "negative-trainer-time", "no-trainer-time", "bad-length", "bad-entry"],
)
def test_a_calibration_file_is_checked_when_it_loads_naming_the_field(tmp_path, capsys, change, named):
    from rollflow.sim.calibrate import Calibration

    good = Calibration(
        engine=EngineProfile(fixed_s=0.002, per_seq_s=1e-4, step_table=((1, 0.002), (32, 0.005))),
        trainer=TrainerProfile(s_per_token=8e-5, fixed_s=0.1, weight_bytes=2 * 10**6, sync_bytes_per_s=1e9),
        lengths=[20, 30], prompt_tokens=16, machine="m",
    )
    good.save(tmp_path / "profile.json")
    data = json.loads((tmp_path / "profile.json").read_text())
    change(data)
    (tmp_path / "profile.json").write_text(json.dumps(data))
    began = time.monotonic()
    assert main(["simulate", "--profile", str(tmp_path / "profile.json"), "--steps", "2"]) == 2
    err = capsys.readouterr().err
    assert time.monotonic() - began < 10
    assert re.search(named, err), err


def test_the_trainer_is_slowed_in_proportion_to_the_engines_batch():
    """Contention measured beside an engine decoding 32 requests slows a step that starts beside
    8 of them by a quarter as much; with no batch given, by all of it whenever the engine runs."""

    class Running:
        generating, running, replicas = True, 8, [object()]

    trainer = SimTrainer(TrainerProfile(s_per_token=1e-6, contended=1.4, contended_batch=32))
    trainer.engine = Running()  # type: ignore[assignment]
    assert trainer.contention() == pytest.approx(1.1)
    trainer.profile = replace(trainer.profile, contended_batch=0)
    assert trainer.contention() == pytest.approx(1.4)
    Running.generating = False
    assert trainer.contention() == 1.0
