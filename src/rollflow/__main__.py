"""`python -m rollflow <command>`: the command line.

Commands: `train` (asynchronous GRPO training; `--resume` continues from the latest checkpoint),
`generate` (sample and score completions from the configured model and task), `eval` (held-out
accuracy and pass@k as JSON), `export` (a checkpoint as a Hugging Face folder), `plot` and
`report` (charts and a summary of finished runs), `ledger` (audit a run's prompt accounting),
`simulate` (predicted throughput and staleness for a GPU setup).
User errors (config, data, model path, arguments) print one line naming what is wrong and
exit with code 2, without a traceback; other rollflow errors print their message and exit 1.
During training the first SIGINT or SIGTERM stops after the current step with a checkpoint
(exit 0); a second SIGINT interrupts at once (exit 130; within `STOP_GRACE_S` even while the
event loop is blocked). This module parses arguments and prints; the work happens in the library.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from rollflow.errors import RollflowError, UserInputError


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", type=Path, help="TOML config file (optional)")
    parser.add_argument(
        "-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="log at INFO level (vLLM too)"
    )
    parser.add_argument("--preset", help="start from a built-in preset: tiny, default")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY.PATH=VALUE",
        help="override one config field, e.g. --set sampling.max_tokens=32 (repeatable)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m rollflow", description="Asynchronous RL post-training for language models.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level (vLLM too)")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    train = commands.add_parser("train", help="run asynchronous GRPO training")
    _add_config_args(train)
    train.add_argument("--max-steps", type=int, default=None, help="override run.max_steps")
    train.add_argument(
        "--output-dir", type=Path, required=True, help="where config.toml, metrics.jsonl, ledger.jsonl go"
    )
    train.add_argument(
        "--resume", action="store_true", help="continue the run in --output-dir from its latest checkpoint"
    )
    ledger = commands.add_parser(
        "ledger", help="audit a run's ledger: trained, dropped by reason, duplicates and missing (exit 1 if any)"
    )
    ledger.add_argument("run", type=Path, metavar="DIR", help="output directory of a training run")
    plot = commands.add_parser("plot", help="write PNG charts of finished runs (timeline, reward, staleness)")
    plot.add_argument("runs", nargs="+", type=Path, metavar="DIR", help="output directories of training runs")
    plot.add_argument("--out", type=Path, default=None, help="where the PNGs go (default: the (first) run directory)")
    report = commands.add_parser("report", help="print a summary table of a finished run")
    report.add_argument("run", type=Path, metavar="DIR", help="output directory of a training run")
    sim = commands.add_parser(
        "simulate", help="predict throughput, idle time and staleness for a GPU setup (virtual time, seconds)"
    )
    sim.add_argument("--model-size", default="7B", choices=["7B", "32B"], help="timing profile (default 7B)")
    sim.add_argument("--gpu", default="H100", choices=["H100", "H200"], help="GPU type (default H100)")
    sim.add_argument("--inference-gpus", type=int, default=1, help="engine replicas, one GPU each (default 1)")
    sim.add_argument("--trainer-gpus", type=int, default=1, help="data-parallel trainer GPUs (default 1)")
    sim.add_argument("--max-lag", type=int, default=1, help="staleness bound (default 1)")
    sim.add_argument("--partial", default="keep", choices=["keep", "resume", "restart"], help="partial rollout mode")
    sim.add_argument(
        "--lengths",
        default="lognormal:300,0.8",
        metavar="lognormal:MEAN,SIGMA|FILE",
        help="completion lengths: a lognormal, a run's ledger.jsonl or trace.json, or a file of lengths",
    )
    sim.add_argument("--rho", type=float, default=0.5, help="within-group correlation of log-lengths (default 0.5)")
    sim.add_argument("--steps", type=int, default=30, help="optimizer steps (default 30)")
    sim.add_argument("--groups", type=int, default=32, help="groups per step (default 32)")
    sim.add_argument("--group-size", type=int, default=8, help="samples per group (default 8)")
    sim.add_argument("--prompt-tokens", type=int, default=256, help="prompt length in tokens (default 256)")
    sim.add_argument("--max-tokens", type=int, default=1024, help="completion budget (default 1024)")
    sim.add_argument("--sweep", metavar="NAME=V1,V2,...", help="vary one parameter, e.g. inference-gpus=1,2,4,8")
    sim.add_argument("--plot", type=Path, metavar="PNG", help="with --sweep: chart steps/hour and idle time")
    sim.add_argument("--output-dir", type=Path, help="keep the simulated run's files (metrics, ledger, trace)")
    serve = commands.add_parser(
        "serve-engine", help="run a vLLM server that training runs can generate with (engine.url)"
    )
    _add_config_args(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    serve.add_argument("--print-command", action="store_true", help="print the vLLM command line and exit")
    gen = commands.add_parser("generate", help="sample completions for task prompts and score them")
    _add_model_args(gen)
    gen.add_argument("--prompts", type=int, default=16, help="number of prompts (default 16)")
    gen.add_argument("--greedy", action="store_true", help="greedy decoding, one sample per prompt")
    ev = commands.add_parser("eval", help="greedy accuracy (and pass@k) of a model on held-out task prompts, as JSON")
    _add_model_args(ev)
    ev.add_argument("--prompts", type=int, default=64, help="number of held-out prompts (default 64)")
    ev.add_argument("--pass-k", type=int, default=0, metavar="K", help="also sample K per prompt for pass@K")
    ev.add_argument("--out", type=Path, default=None, help="write the JSON here too (default: print only)")
    export = commands.add_parser(
        "export", help="write a run's trained policy from a checkpoint as a Hugging Face folder"
    )
    export.add_argument("run", type=Path, metavar="DIR", help="output directory of a training run")
    export.add_argument("--step", type=int, default=None, help="the checkpoint after this step (default: latest)")
    export.add_argument("--out", type=Path, default=None, help="where the folder goes (default DIR/export/step-N)")
    export.add_argument("--merged", action="store_true", help="LoRA runs: the base model with the adapter merged in")
    return parser


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    _add_config_args(parser)
    parser.add_argument("--model", default=None, help="the model to use (sets model.path), e.g. runs/x/final")
    parser.add_argument(
        "--run", type=Path, default=None, metavar="DIR", help="a training run: its config and its final/ model"
    )


def _model_config(args: argparse.Namespace):  # -> Config
    """The config for `generate` / `eval`: a run's (`--run`) or the given one, with `--model`."""
    from rollflow.config import load_config
    from rollflow.export import FINAL

    config_file, overrides = args.config, list(args.overrides)
    model = args.model
    if args.run is not None:
        if config_file is not None or args.preset:
            raise UserInputError("--run: takes the run's own config.toml; give no CONFIG or --preset with it")
        config_file = args.run / "config.toml"
        if not config_file.is_file():
            raise UserInputError(f"--run {args.run}: not a rollflow run directory (no config.toml)")
        final = args.run / FINAL
        if model is None:
            if (final / "adapter_config.json").is_file():
                raise UserInputError(
                    f"--run {args.run}: its final/ is a LoRA adapter; write a merged model with "
                    f"`python -m rollflow export {args.run} --merged` and pass it as --model"
                )
            if not (final / "config.json").is_file():
                raise UserInputError(f"--run {args.run}: no trained model in {final} (the run did not finish)")
            model = str(final)
    if model is not None:
        overrides.append(f"model.path={json.dumps(str(model))}")
    return load_config(config_file, preset=args.preset, overrides=overrides)


def _serve_engine(args: argparse.Namespace) -> int:
    """Replace this process with a vLLM server for the configured model and engine settings."""
    import shlex

    from rollflow.config import load_config
    from rollflow.engine.environment import check_kv_cache, resolve_context, serve_command, serve_environment
    from rollflow.models import resolve_model

    config = load_config(args.config, preset=args.preset, overrides=args.overrides)
    model = resolve_model(config.model.path)
    check_kv_cache(model, resolve_context(config.engine, model), config.model.dtype)
    command = serve_command(model, config.engine, host=args.host, port=args.port, dtype=config.model.dtype)
    if args.print_command:
        print("VLLM_SERVER_DEV_MODE=1 " + shlex.join(command))
        return 0
    print(f"serving {config.model.path} at http://{args.host}:{args.port} (engine.url)", file=sys.stderr)
    sys.stderr.flush()
    os.execve(command[0], command, serve_environment(config.engine))


async def _started_engine(config, console):  # -> (VLLMEngine, tokenizer), started
    from rollflow.engine.vllm import VLLMEngine
    from rollflow.models import load_tokenizer, resolve_model

    with console.status(f"preparing model {config.model.path}"):
        model_path = resolve_model(config.model.path)
        tokenizer = load_tokenizer(model_path)
    engine = VLLMEngine(model_path, config.engine, dtype=config.model.dtype)
    with console.status("starting vLLM engine (20-40 s on CPU)"):
        await engine.start()
    return engine, tokenizer


def _counting(status, what: str, total: int):  # -> Callable[[Sample], None]
    done = 0
    status.update(f"{what} 0/{total} samples")

    def progress(_sample: object) -> None:
        nonlocal done
        done += 1
        status.update(f"{what} {done}/{total} samples")

    return progress


async def _generate(args: argparse.Namespace) -> int:
    from rich.console import Console

    from rollflow.evaluate import evaluate, sampling_spec
    from rollflow.models import prompt_encoder
    from rollflow.sampler import Sampler

    if args.prompts <= 0:
        raise UserInputError(f"--prompts: expected a positive number, got {args.prompts}")
    console = Console(stderr=True)
    config = _model_config(args)
    group = 1 if args.greedy else config.rollout.group_size
    engine, tokenizer = await _started_engine(config, console)
    try:
        sampler = Sampler(config.data, prompt_encoder(tokenizer, config.data))
        prompts = [sampler.next() for _ in range(args.prompts)]
        with console.status("generating") as status:
            report = await evaluate(
                engine,
                prompts,
                sampling_spec(config, greedy=args.greedy),
                samples_per_prompt=group,
                decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                on_sample=_counting(status, "generating", len(prompts) * group),
            )
    finally:
        await engine.aclose()
    for question, text, reward in report.examples:
        console.print(f"[bold]{question}[/bold] -> {text.strip()!r} reward={reward:g}", highlight=False)
    print(
        f"model={config.model.path} task={config.data.task} prompts={report.prompts} samples={report.samples} "
        f"accuracy={report.accuracy:.3f} pass@{group}={report.pass_at_group:.3f} "
        f"tokens={report.tokens} wall_s={report.wall_s:.1f} tokens_per_s={report.tokens_per_s:.0f}"
    )
    return 0


async def _eval(args: argparse.Namespace) -> int:
    from rich.console import Console

    if args.prompts <= 0:
        raise UserInputError(f"--prompts: expected a positive number, got {args.prompts}")
    if args.pass_k < 0:
        raise UserInputError(f"--pass-k: expected 0 or more samples per prompt, got {args.pass_k}")
    from rollflow.evaluate import held_out_report

    console = Console(stderr=True)
    config = _model_config(args)
    engine, tokenizer = await _started_engine(config, console)
    try:
        with console.status("evaluating") as status:
            progress = _counting(status, "evaluating", args.prompts * (1 + args.pass_k))
            report = await held_out_report(engine, config, tokenizer, args.prompts, args.pass_k, on_sample=progress)
    finally:
        await engine.aclose()
    text = json.dumps(report)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(text)
    return 0


def _export(args: argparse.Namespace) -> int:
    from rollflow.export import export_checkpoint

    if args.step is not None and args.step < 0:
        raise UserInputError(f"--step: expected a step count of 0 or more, got {args.step}")
    out = export_checkpoint(args.run, step=args.step, out=args.out, merged=args.merged)
    print(out)
    return 0


async def _train(args: argparse.Namespace) -> int:
    from rollflow.config import load_config
    from rollflow.controller import Controller

    overrides = list(args.overrides)
    if args.max_steps is not None:
        if args.max_steps <= 0:
            raise UserInputError(f"--max-steps: expected a positive number, got {args.max_steps}")
        overrides.append(f"run.max_steps={args.max_steps}")
    config = load_config(args.config, preset=args.preset, overrides=overrides)
    controller = Controller(config, args.output_dir, resume=args.resume)
    loop = asyncio.get_running_loop()
    loop.set_default_executor(_NoWaitExecutor(thread_name_prefix="rollflow-calls"))
    main_task = asyncio.current_task()
    assert main_task is not None
    stop_on_signals(loop, controller.request_stop, main_task.cancel)
    try:
        result = await controller.run()
    except asyncio.CancelledError:
        raise KeyboardInterrupt from None
    if result.stopped:
        print(
            f"stopped after step {result.first_step + result.steps}; checkpoint {result.checkpoint}; "
            f"continue with: python -m rollflow train ... --output-dir {args.output_dir} --resume"
        )
        return 0
    if not result.metrics:
        print(f"nothing to do: output_dir={args.output_dir}")
        return 0
    first, last = result.metrics[0], result.metrics[-1]
    resumed = f"resumed_from_step={result.first_step} " if result.first_step else ""
    print(
        f"{resumed}steps={result.steps} wall_s={result.wall_s:.0f} reward_first={first['reward_mean']:.3f} "
        f"reward_last={last['reward_mean']:.3f} trained_prompts={result.trained_prompts} "
        f"dropped={sum(result.dropped.values())} output_dir={args.output_dir}"
    )
    if result.final_model:
        print(f"trained model: {result.final_model} (python -m rollflow generate --model {result.final_model})")
    if result.eval_before is not None and result.eval_after is not None:
        print(
            f"held-out accuracy ({result.eval_before.prompts} prompts, greedy): "
            f"before={result.eval_before.accuracy:.3f} after={result.eval_after.accuracy:.3f}"
        )
    return 0


def _use_uvloop() -> None:
    """The CLI's loop is uvloop when installed (the library runs on whatever loop calls it)."""
    if os.environ.get("ROLLFLOW_NO_UVLOOP"):
        return
    try:
        import uvloop
    except ImportError:
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    if args.verbose:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO")
    else:
        from rollflow.engine.quiet import quiet_this_process

        quiet_this_process()  # known-harmless third-party warnings (-v shows them)
    try:
        if args.command == "plot":
            from rollflow.plots import plot

            for path in plot(args.runs, args.out):
                print(path)
            return 0
        if args.command == "report":
            from rollflow.plots import report

            print(report(args.run))
            return 0
        if args.command == "ledger":
            from rollflow.ledger import summarize

            summary = summarize(args.run)
            print(summary.format())
            return 0 if summary.ok else 1
        if args.command == "simulate":
            from rollflow.sim.cli import run_simulate

            return run_simulate(args)
        if args.command == "serve-engine":
            return _serve_engine(args)
        _use_uvloop()
        if args.command == "export":
            return _export(args)
        if args.command == "generate":
            return asyncio.run(_generate(args))
        if args.command == "eval":
            return asyncio.run(_eval(args))
        if args.command == "train":
            from rollflow.ranks import main_or_follow

            return main_or_follow(lambda: asyncio.run(_train(args)), args)
    except UserInputError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except RollflowError as err:
        logging.getLogger("rollflow").debug("error", exc_info=True)
        print(f"error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 2


STOP_GRACE_S = 5.0
"""After a second Ctrl-C, how long the run may take to stop before the process exits anyway."""


def stop_on_signals(
    loop: asyncio.AbstractEventLoop,
    stop: Callable[[], object],
    cancel: Callable[[], object],
    grace_s: float = STOP_GRACE_S,
) -> None:
    """SIGINT / SIGTERM: the first asks the run to stop after its step (`stop`); the second
    cancels it (`cancel`), and if the process is still alive `grace_s` later (an event loop
    blocked by user code or by a huge allocation never runs the cancellation), it exits with
    130; a third exits at once.

    The handlers are plain signal handlers, which Python runs between bytecodes on the main
    thread even while the event loop is blocked; they only hand work to the loop
    (`call_soon_threadsafe`), whose callbacks cannot run until it is free again."""
    count = 0

    def now(reason: str) -> None:
        print(f"\n{reason}; exiting now (status 130)", file=sys.stderr)
        atexit._run_exitfuncs()  # remove the run's sockets and folders, as a normal exit does
        sys.stderr.flush()
        os._exit(130)

    def on_signal(signum: int, _frame: object) -> None:
        nonlocal count
        count += 1
        name = signal.Signals(signum).name
        if count == 1:
            print(f"\n{name}: stopping after the current step with a checkpoint (again to stop now)", file=sys.stderr)
            loop.call_soon_threadsafe(stop)
        elif count == 2:
            print(f"\n{name}: stopping now", file=sys.stderr)
            loop.call_soon_threadsafe(cancel)
            timer = threading.Timer(grace_s, now, args=(f"the run did not stop within {grace_s:g} s",))
            timer.daemon = True
            timer.start()
        else:
            now(f"{name} a third time")

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)


class _NoWaitExecutor(ThreadPoolExecutor):
    """The command line's default executor: when the run ends it does not wait for a call that
    has not returned (a user's tool that hangs past its timeout)."""

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        super().shutdown(wait=False, cancel_futures=True)


USER_CALL_THREADS = ("rollflow-reward", "rollflow-calls")
"""Threads that run users' functions (sync rewards, tools)."""


def _exit(code: int) -> None:
    """Exit with `code`, now: a user's function still running on a thread (a reward or tool call
    that hung past its timeout) must not keep the process alive after the run has ended."""
    deadline = time.monotonic() + 1.0  # idle pool threads end within moments of their shutdown
    stuck = []
    for thread in threading.enumerate():
        if thread.name.startswith(USER_CALL_THREADS):
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                stuck.append(thread.name)
    if not stuck:
        sys.exit(code)
    print(f"not waiting for {len(stuck)} user call(s) that never returned", file=sys.stderr)
    atexit._run_exitfuncs()  # what a normal exit runs (removing the run's sockets, ...)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _exit(main())
