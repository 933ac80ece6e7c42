"""Pictures and a summary of finished runs: `python -m rollflow plot DIR...` and `report DIR`.

Reads what a run leaves in its output directory (`metrics.jsonl`, `ledger.jsonl`, `trace.json`)
and writes PNGs with matplotlib (Agg backend, no display needed):

- `timeline.png`: engine generating vs trainer stepping vs the engine's weight loads over
  wall time, the picture of the overlap (and of a synchronous run's idle gaps);
- `reward.png`, `staleness.png` (token lag histogram over the run), `staleness_by_cause.png`
  (sample lag in flight beside sample lag in the queue), `throughput.png`;
- with several runs, `timeline_compare.png`: their timelines stacked on one time axis.

`report` prints a short table. This module only reads runs; it never changes them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rollflow.errors import UserInputError
from rollflow.trace import load_trace

ROWS = (("engine generating", "#4c72b0"), ("trainer step", "#dd8452"), ("weight load", "#55a868"))


def _jsonl(path: Path) -> list[dict[str, Any]]:
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as err:
            raise UserInputError(f"{path}:{number}: not a JSON object ({err.msg})") from None
    return rows


def load_run(directory: str | Path) -> dict[str, Any]:
    """Metrics, ledger and (when present) trace spans of one run directory."""
    directory = Path(directory)
    metrics_path = directory / "metrics.jsonl"
    if not metrics_path.is_file():
        raise UserInputError(f"{directory}: no metrics.jsonl here; expected the output directory of a training run")
    run: dict[str, Any] = {"dir": directory, "metrics": _jsonl(metrics_path), "ledger": [], "spans": None}
    if not run["metrics"]:
        raise UserInputError(f"{metrics_path}: empty; the run finished no step")
    if (directory / "ledger.jsonl").is_file():
        run["ledger"] = _jsonl(directory / "ledger.jsonl")
    if (directory / "trace.json").is_file():
        try:
            run["spans"] = load_trace(directory / "trace.json")["spans"]
        except ValueError as err:
            raise UserInputError(str(err)) from None
    return run


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Merge overlapping intervals."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def activity(spans: list[dict[str, Any]]) -> dict[str, list[tuple[float, float]]]:
    """Busy intervals of each timeline row, from trace spans."""
    pick = {
        "engine generating": lambda s: s["track"].startswith("generate"),
        "trainer step": lambda s: s["name"] == "train step",
        "weight load": lambda s: s["name"] == "engine update",
    }
    return {row: union([(s["start"], s["end"]) for s in spans if test(s)]) for row, test in pick.items()}


def _extent(rows: dict[str, list[tuple[float, float]]]) -> tuple[float, float]:
    """First start and last end over all rows."""
    starts = [iv[0][0] for iv in rows.values() if iv]
    ends = [iv[-1][1] for iv in rows.values() if iv]
    return min(starts, default=0.0), max(ends, default=1.0)


def _timeline(ax: Any, run: dict[str, Any], title: str, x_max: float | None = None) -> None:
    rows = activity(run["spans"] or [])
    origin, end = _extent(rows)
    for y, (name, color) in enumerate(ROWS):
        bars = [(start - origin, end - start) for start, end in rows[name]]
        ax.broken_barh(bars, (len(ROWS) - 1 - y - 0.35, 0.7), facecolors=color)
    ax.set_yticks(range(len(ROWS)), [name for name, _ in reversed(ROWS)])
    ax.set_xlim(0, x_max if x_max is not None else end - origin)
    ax.set_xlabel("seconds since the first request")
    ax.set_title(title, fontsize=10, loc="left")
    ax.grid(axis="x", alpha=0.3)


def _summary_title(run: dict[str, Any]) -> str:
    steady = run["metrics"][1:] or run["metrics"]
    cfg_lag = _max_lag(run)
    mode = "synchronous (max_lag 0)" if cfg_lag == 0 else f"asynchronous (max_lag {cfg_lag})" if cfg_lag else ""
    name = run["dir"].name if run["dir"].name not in mode else ""
    wall = run["metrics"][-1]["wall_s"] - (run["metrics"][0]["wall_s"] if len(run["metrics"]) > 1 else 0)
    idle_t = sum(m["trainer_idle_frac"] for m in steady) / len(steady)
    idle_e = sum(m.get("engine_idle_frac", 0.0) for m in steady) / len(steady)
    return (
        f"{': '.join(x for x in (name, mode) if x)}  {len(run['metrics'])} steps, steady state {wall:.1f} s,"
        f" trainer idle {idle_t:.0%}, engine idle {idle_e:.0%}"
    )


def _max_lag(run: dict[str, Any]) -> int | None:
    """The run's `run.max_lag`, read through the config loader (a setting left out is its
    default); None without a readable config.toml."""
    config = run["dir"] / "config.toml"
    if not config.is_file():
        return None
    from rollflow.config import load_config
    from rollflow.errors import ConfigError

    try:
        return load_config(config).run.max_lag
    except ConfigError:
        return None


def plot(directories: list[str | Path], out: str | Path | None = None) -> list[Path]:
    """Write the PNGs of each run (into `out`, default each run's directory; with several runs,
    into `out`, default the first run's directory, plus `timeline_compare.png`). Returns paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [load_run(d) for d in directories]
    written: list[Path] = []
    for run in runs:
        target = Path(out) / run["dir"].name if out and len(runs) > 1 else Path(out or run["dir"])
        target.mkdir(parents=True, exist_ok=True)
        written += _plot_one(plt, run, target)
    if len(runs) > 1:
        if any(r["spans"] is None for r in runs):
            raise UserInputError("plot: comparing timelines needs trace.json in every run directory")
        durations = [end - start for start, end in (_extent(activity(r["spans"])) for r in runs)]
        fig, axes = plt.subplots(len(runs), 1, figsize=(11, 1.9 * len(runs) + 0.6), sharex=True, squeeze=False)
        for ax, run in zip(axes[:, 0], runs, strict=True):
            _timeline(ax, run, _summary_title(run), x_max=max(durations))
        fig.tight_layout()
        path = Path(out or runs[0]["dir"]) / "timeline_compare.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def _plot_one(plt: Any, run: dict[str, Any], target: Path) -> list[Path]:
    metrics = run["metrics"]
    steps = [m["step"] + 1 for m in metrics]
    written = []

    def save(fig: Any, name: str) -> None:
        fig.tight_layout()
        fig.savefig(target / name, dpi=110)
        plt.close(fig)
        written.append(target / name)

    if run["spans"] is not None:
        fig, ax = plt.subplots(figsize=(11, 2.5))
        _timeline(ax, run, _summary_title(run))
        save(fig, "timeline.png")

    fig, ax = plt.subplots(figsize=(6, 3.5))
    mean = [m["reward_mean"] for m in metrics]
    std = [m["reward_std"] for m in metrics]
    ax.plot(steps, mean, marker="o", ms=3, label="reward mean")
    ax.fill_between(
        steps,
        [a - b for a, b in zip(mean, std, strict=True)],
        [a + b for a, b in zip(mean, std, strict=True)],
        alpha=0.2,
        label="± std",
    )
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.legend()
    ax.set_title("reward per step", fontsize=10, loc="left")
    save(fig, "reward.png")

    evaluated = [m for m in metrics if "eval_accuracy" in m]
    if evaluated:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        x = [m["step"] + 1 for m in evaluated]
        ax.plot(x, [m["eval_accuracy"] for m in evaluated], marker="o", ms=3, label="greedy accuracy")
        if any("eval_pass_at_k" in m for m in evaluated):
            at_k = [m for m in evaluated if "eval_pass_at_k" in m]
            ax.plot(
                [m["step"] + 1 for m in at_k], [m["eval_pass_at_k"] for m in at_k], marker="s", ms=3, label="pass@k"
            )
        ax.set_xlabel("step")
        ax.set_ylabel("held-out score")
        ax.set_ylim(0, 1.05)
        ax.legend()
        ax.set_title("held-out evaluation during training", fontsize=10, loc="left")
        save(fig, "eval.png")

    _staleness(plt, metrics, save)

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, [m["gen_tokens_per_s"] for m in metrics], marker="o", ms=3, label="generated tokens/s")
    ax.plot(steps, [m.get("trained_tokens_per_s", 0.0) for m in metrics], marker="o", ms=3, label="trained tokens/s")
    ax.set_xlabel("step")
    ax.set_ylabel("tokens / s")
    ax.legend()
    ax.set_title("throughput per step", fontsize=10, loc="left")
    save(fig, "throughput.png")
    return written


def _staleness(plt: Any, metrics: list[dict[str, Any]], save: Callable[[Any, str], None]) -> None:
    """staleness.png (token lag over the run) and staleness_by_cause.png (sample lag in flight
    beside sample lag in the queue)."""
    fig, ax = plt.subplots(figsize=(6, 3.5))
    hist = lag_histogram(metrics)
    total = sum(hist.values()) or 1
    ax.bar([str(k) for k in hist], [v / total for v in hist.values()], color="#4c72b0")
    ax.set_xlabel("token lag (versions behind the trained policy)")
    ax.set_ylabel("share of tokens")
    ax.set_title("staleness over the run", fontsize=10, loc="left")
    save(fig, "staleness.png")

    fig, ax = plt.subplots(figsize=(6, 3.5))
    causes = {"in flight": "lag_in_flight_hist", "in the queue": "lag_in_queue_hist"}
    lags = sorted({lag for key in causes.values() for lag in lag_histogram(metrics, key)})
    for shift, (label, key) in zip((-0.2, 0.2), causes.items(), strict=True):
        by_cause = lag_histogram(metrics, key)
        total = sum(by_cause.values()) or 1
        ax.bar([lag + shift for lag in lags], [by_cause.get(lag, 0) / total for lag in lags], width=0.4, label=label)
    ax.set_xticks(lags)
    ax.set_xlabel("sample lag by cause (versions)")
    ax.set_ylabel("share of samples")
    ax.legend()
    ax.set_title("staleness by cause: generating vs waiting for the trainer", fontsize=10, loc="left")
    save(fig, "staleness_by_cause.png")


def lag_histogram(metrics: list[dict[str, Any]], key: str = "lag_hist") -> dict[int, int]:
    """Lag counts summed over all steps: tokens' (`lag_hist`), or samples' by cause
    (`lag_in_flight_hist`, `lag_in_queue_hist`)."""
    hist: dict[int, int] = {}
    for m in metrics:
        for lag, count in m.get(key, {}).items():
            hist[int(lag)] = hist.get(int(lag), 0) + count
    return dict(sorted(hist.items()))


def report(directory: str | Path) -> str:
    """A short summary table of one run."""
    run = load_run(directory)
    metrics, ledger = run["metrics"], run["ledger"]
    steady = metrics[1:] or metrics
    n = len(steady)
    k = max(1, min(3, len(metrics) // 2))
    ids = [e["id"] for e in ledger]
    dropped: dict[str, int] = {}
    for e in ledger:
        if e["outcome"] == "dropped":
            reason = e.get("reason", "?")
            dropped[reason] = dropped.get(reason, 0) + 1
    rows = [
        ("run", str(run["dir"])),
        ("steps", f"{len(metrics)} (max_lag {_max_lag(run)})"),
        (
            "wall time",
            f"{metrics[-1]['wall_s']:.1f} s; steady state (after step 1) "
            f"{metrics[-1]['wall_s'] - metrics[0]['wall_s']:.1f} s",
        ),
        (
            "reward",
            f"{sum(m['reward_mean'] for m in metrics[:k]) / k:.3f} (first {k} steps) -> "
            f"{sum(m['reward_mean'] for m in metrics[-k:]) / k:.3f} (last {k})",
        ),
        ("trainer idle", f"{sum(m['trainer_idle_frac'] for m in steady) / n:.1%}"),
        ("engine idle", f"{sum(m.get('engine_idle_frac', 0.0) for m in steady) / n:.1%}"),
        ("generated tokens/s", f"{sum(m['gen_tokens_per_s'] for m in steady) / n:.0f}"),
        ("token lag", _shares(lag_histogram(metrics))),
        ("sample lag in flight", _shares(lag_histogram(metrics, "lag_in_flight_hist"))),
        ("sample lag in queue", _shares(lag_histogram(metrics, "lag_in_queue_hist"))),
        ("withheld tokens", str(sum(m["withheld_tokens"] for m in metrics))),
        ("samples mixing versions", str(sum(m.get("mixed_version_samples", 0) for m in metrics))),
        ("unscorable samples", str(sum(m["unscorable"] for m in metrics))),
        (
            "weight sync",
            f"trainer waited {sum(m['weight_sync_s'] for m in metrics) / len(metrics):.3f} s/step, "
            f"engine load {sum(m.get('engine_update_s', 0.0) for m in steady) / n:.3f} s",
        ),
        (
            "prompts",
            f"{sum(1 for e in ledger if e['outcome'] == 'trained')} trained, "
            f"{sum(dropped.values())} dropped, {len(ids) - len(set(ids))} duplicates",
        ),
    ]
    rows += [(f"  dropped: {reason}", str(count)) for reason, count in sorted(dropped.items())]
    evaluated = [m for m in metrics if "eval_accuracy" in m]
    if evaluated:
        curve = "  ".join(f"{m['step'] + 1}: {m['eval_accuracy']:.3f}" for m in evaluated)
        rows.append(("held-out accuracy", f"after step {curve}"))
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def _shares(hist: dict[int, int]) -> str:
    """`lag: share` for each lag of a histogram, or `-` when it is empty."""
    total = sum(hist.values()) or 1
    return "  ".join(f"{lag}: {count / total:.1%}" for lag, count in hist.items()) or "-"
