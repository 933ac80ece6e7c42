"""`serve-engine`: replace this process with a vLLM server for the configured model and engine
settings, which training runs generate with (`engine.urls`)."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from typing import Any

from rollflow.cli.parser import add_config_args

NAME = "serve-engine"
ASYNC = False


def add(commands: Any) -> None:
    serve = commands.add_parser(NAME, help="run a vLLM server that training runs can generate with (engine.url)")
    add_config_args(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    serve.add_argument("--print-command", action="store_true", help="print the vLLM command line and exit")


def run(args: argparse.Namespace) -> int:
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
