"""`train`: asynchronous GRPO training, and what stops it cleanly.

During training the first SIGINT or SIGTERM stops after the current step with a checkpoint
(exit 0), or cancels the run if that step has not ended `STOP_WAIT_S` later; a second SIGINT
interrupts at once (exit 130; within `STOP_GRACE_S` even while the event loop is blocked).
Several trainer ranks under torchrun: rank 0 runs the controller, the others follow it
(`rollflow.ranks`).
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import os
import signal
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from rollflow.cli.parser import add_config_args
from rollflow.errors import UserInputError

NAME = "train"
ASYNC = True


def add(commands: Any) -> None:
    train = commands.add_parser(NAME, help="run asynchronous GRPO training")
    add_config_args(train)
    train.add_argument("--max-steps", type=int, default=None, help="override run.max_steps")
    train.add_argument(
        "--output-dir", type=Path, required=True, help="where config.toml, metrics.jsonl, ledger.jsonl go"
    )
    train.add_argument(
        "--resume", action="store_true", help="continue the run in --output-dir from its latest checkpoint"
    )


def run(args: argparse.Namespace) -> int:
    from rollflow.ranks import main_or_follow

    return main_or_follow(lambda: asyncio.run(_train(args)), args)


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
    if result.pass_before is not None and result.pass_after is not None:
        k = result.pass_after.samples // max(result.pass_after.prompts, 1)
        print(
            f"held-out pass@{k} ({result.pass_after.prompts} prompts, sampled): "
            f"before={result.pass_before.pass_at_group:.3f} after={result.pass_after.pass_at_group:.3f}"
        )
    return 0


STOP_GRACE_S = 5.0
"""After a second Ctrl-C, how long the run may take to stop before the process exits anyway."""

STOP_WAIT_S = 8.0
"""After the first Ctrl-C or SIGTERM, how long the run may take to end its step and checkpoint
before it is cancelled as by a second signal (a step held by stuck code never ends); with
`STOP_GRACE_S` after it, one signal ends any run within 15 s."""

BLOCKED_LOOP_S = 10.0
"""After the first Ctrl-C or SIGTERM, how long the event loop has to take the stop request (it
does at once unless code blocks it) before the process exits anyway."""


def stop_on_signals(
    loop: asyncio.AbstractEventLoop,
    stop: Callable[[], object],
    cancel: Callable[[], object],
    grace_s: float = STOP_GRACE_S,
    blocked_s: float = BLOCKED_LOOP_S,
    stop_s: float = STOP_WAIT_S,
) -> None:
    """SIGINT / SIGTERM: the first asks the run to stop after its step (`stop`); the second
    cancels it (`cancel`), and if the process is still alive `grace_s` later (an event loop
    blocked by user code or by a huge allocation never runs the cancellation), it exits with
    130; a third exits at once. A first signal whose run has not ended `stop_s` later (its step
    waits for code that never returns) cancels it as a second would. A first signal whose request
    the event loop has not taken `blocked_s` later (code blocks the loop, so no step can end
    either) exits with 130 too.

    The handlers are plain signal handlers, which Python runs between bytecodes on the main
    thread even while the event loop is blocked; they only hand work to the loop
    (`call_soon_threadsafe`), whose callbacks cannot run until it is free again. Exiting runs
    the process's exit hooks (the run's status.json records why, its sockets and folders go)."""
    count = 0

    def after(seconds: float, reason: str, unless: threading.Event | None = None) -> None:
        _later(seconds, lambda: None if unless is not None and unless.is_set() else _exit_now(reason))

    def cancel_now(why: str) -> None:
        print(f"\n{why}; stopping now", file=sys.stderr)
        loop.call_soon_threadsafe(cancel)
        after(grace_s, f"the run did not stop within {grace_s:g} s")

    def on_signal(signum: int, _frame: object) -> None:
        nonlocal count
        count += 1
        name = signal.Signals(signum).name
        if count == 1:
            print(
                f"\n{name}: stopping after the current step with a checkpoint (again to stop now; a step not "
                f"done within {stop_s:g} s is cancelled, and --resume continues from the last checkpoint)",
                file=sys.stderr,
            )
            taken = threading.Event()

            def take() -> None:
                taken.set()
                stop()

            loop.call_soon_threadsafe(take)
            after(
                blocked_s,
                f"the event loop did not take the stop request within {blocked_s:g} s (code blocks it)",
                taken,
            )

            def overdue() -> None:
                if count == 1:  # a second signal has cancelled it already
                    cancel_now(f"the run did not stop within {stop_s:g} s of {name}")

            _later(stop_s, overdue)
        elif count == 2:
            cancel_now(name)
        else:
            _exit_now(f"{name} a third time")

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)


def _exit_now(reason: str) -> None:
    """Exit with 130 at once, the run's status saying `reason` (from a signal handler or a timer)."""
    print(f"\n{reason}; exiting now (status 130)", file=sys.stderr)
    from rollflow.rundir import exiting

    exiting(reason)
    atexit._run_exitfuncs()  # remove the run's sockets and folders, as a normal exit does
    sys.stderr.flush()
    os._exit(130)


def _later(seconds: float, action: Callable[[], object]) -> None:
    """Run `action` on a daemon timer thread `seconds` from now (it never holds the exit)."""
    timer = threading.Timer(seconds, action)
    timer.daemon = True
    timer.start()


class _NoWaitExecutor(ThreadPoolExecutor):
    """The command line's default executor: when the run ends it does not wait for a call that
    has not returned (a user's tool that hangs past its timeout)."""

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        super().shutdown(wait=False, cancel_futures=True)
