"""`python -m rollflow <command>`: the command line, one module per command.

Commands: `train` (asynchronous GRPO training; `--resume` continues from the latest checkpoint),
`ledger` (audit a run's prompt accounting), `plot` and `report` (charts and a summary of finished
runs), `simulate` (predicted throughput and staleness for a GPU setup), `serve-engine` (a vLLM
server runs can generate with), `generate` (sample and score completions from the configured
model and task), `eval` (held-out accuracy and pass@k as JSON), `export` (a checkpoint as a
Hugging Face folder). Each command's module adds its arguments (`add`) and runs it (`run`);
`main` parses, sets up logging and turns errors into exit codes: user errors (config, data, model
path, arguments) print one line naming what is wrong and exit with code 2, without a traceback;
other rollflow errors print their message and exit 1. This package parses arguments and prints;
the work happens in the library.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import logging
import os
import sys
import threading
import time

from rollflow.cli import evaluate, export, generate, ledger, plot, report, serve_engine, simulate, train
from rollflow.cli.parser import Parser
from rollflow.errors import RollflowError, UserInputError

COMMANDS = (train, ledger, plot, report, simulate, serve_engine, generate, evaluate, export)
"""In the order `--help` lists them."""


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="python -m rollflow", description="Asynchronous RL post-training for language models.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level (vLLM too)")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for command in COMMANDS:
        command.add(commands)
    return parser


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
    command = next(c for c in COMMANDS if args.command == c.NAME)
    try:
        if command.ASYNC:
            _use_uvloop()
        return command.run(args)
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


USER_CALL_THREADS = ("rollflow-reward", "rollflow-calls")
"""Threads that run users' functions (sync rewards, tools)."""


def exit_now(code: int) -> None:
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
