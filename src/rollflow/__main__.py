"""`python -m rollflow <command>`: dispatches to the command line (`rollflow.cli`)."""

from rollflow.cli import build_parser, exit_now, main

__all__ = ["build_parser", "main"]

if __name__ == "__main__":
    exit_now(main())
