"""The built-in reward `math_verify`: math-verify's judgement of a completion's final answer.

Each completion is parsed the way math-verify parses (LaTeX, `\\boxed{}`, fractions, plain
expressions) and compared with the row's `answer` by its `verify` (equivalent forms, sets,
intervals, rounding): 1.0 when they agree, 0.0 when they do not or the completion gives no
answer. math-verify's parsing can take very long or never end on hostile text, and its own
timeouts (SIGALRM) work only on a process's main thread, so the work runs in worker processes
(`math_worker.py`, run as a script), each judging one completion at a time with math-verify's
timeouts on, and a worker that has not answered `DEADLINE_S` after it was asked is killed and
replaced. Each judgement is bounded (by `DEADLINE_S` from when a worker takes it), not the
wait for a worker, so a group never times out for the other groups queued before it (the
scorer puts no time limit of its own on this reward). A timeout, and a row whose `answer`
math-verify cannot parse or is not math at all (`Paris`), make that sample unscorable with the
reason; the run goes on.

This module does not parse anything itself; it owns the worker processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from pathlib import Path
from typing import Any

import msgspec

from rollflow.errors import ConfigError
from rollflow.scoring import Unscorable

EXTRA = "pip install 'rollflow[math-verify]'"
"""How to install the library (named in the error when it is missing)."""

WORKER = Path(__file__).with_name("math_worker.py")
"""The worker's script (run as a file, so it does not import rollflow and torch)."""

WORKERS = 2
"""Worker processes judging at once (each holds sympy and math-verify, about 60 MB)."""

PARSE_TIMEOUT_S = 3
"""math-verify's own timeout for each parse and each comparison, whole seconds (SIGALRM)."""

DEADLINE_S = 4.0 * PARSE_TIMEOUT_S
"""How long one completion may take in a worker (the answer and the completion parsed, then
compared, each within `PARSE_TIMEOUT_S`, and slack), past which the worker is killed."""


class Judgement(msgspec.Struct, frozen=True):
    """A worker's answer for one completion: the reward, or why there is none."""

    value: float | None = None
    error: str | None = None


class Request(msgspec.Struct, frozen=True):
    gold: str
    text: str
    timeout_s: int


class _Worker:
    """One worker process: a request line in, a judgement line out."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process

    async def judge(self, request: bytes, deadline_s: float) -> Judgement:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(request)
        await self.process.stdin.drain()
        line = await asyncio.wait_for(self.process.stdout.readline(), deadline_s)
        if not line:
            raise EOFError("the math-verify worker exited")
        return msgspec.json.decode(line, type=Judgement)

    async def kill(self) -> None:
        if self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.kill()
            await self.process.wait()


class MathVerify:
    """The `math_verify` reward, TRL signature: `(prompts, completions, *, answer, ...)`."""

    def __init__(self, workers: int = WORKERS, deadline_s: float = DEADLINE_S, parse_timeout_s: int = PARSE_TIMEOUT_S):
        try:
            import math_verify  # noqa: F401 - fail at start, not in the first group's scoring
        except ImportError as err:
            raise ConfigError(f"the math_verify reward needs the math-verify package ({err}); {EXTRA}") from None
        self.deadline_s = deadline_s
        self.parse_timeout_s = parse_timeout_s
        self._workers = workers
        self._slots: asyncio.Semaphore | None = None
        """One per worker: a completion waits here for a free worker."""
        self._idle: list[_Worker] = []
        self._all: set[_Worker] = set()
        self._jobs: set[asyncio.Task[Judgement]] = set()
        """Judgements under way (they outlive a cancelled caller; `aclose` ends them)."""

    async def __call__(self, prompts: list[str], completions: list[str], *, answer: list[Any], **_: Any) -> list[Any]:
        return list(await asyncio.gather(*(self.judge(a, c) for a, c in zip(answer, completions, strict=True))))

    async def judge(self, gold: Any, text: str) -> float | Unscorable:
        """One completion's reward against the reference answer `gold`. The wait for a free worker
        is not bounded here (every judgement ahead of it is); the judgement itself is, by
        `deadline_s`. A caller cancelled mid-judgement (its group's scoring was) lets the
        judgement finish, so the worker is kept for the next one instead of killed."""
        if gold is None or not str(gold).strip():
            return Unscorable("math_verify: the prompt has no answer to compare with")
        request = msgspec.json.encode(Request(str(gold), text, self.parse_timeout_s)) + b"\n"
        if self._slots is None:
            self._slots = asyncio.Semaphore(self._workers)
        await self._slots.acquire()  # cancelled here, nothing has started
        job = asyncio.create_task(self._judged(request), name="math-verify-judgement")
        self._jobs.add(job)
        job.add_done_callback(self._jobs.discard)
        result = await asyncio.shield(job)
        if result.error is not None:
            return Unscorable(f"math_verify: {result.error}")
        assert result.value is not None
        return result.value

    async def _judged(self, request: bytes) -> Judgement:
        """One judgement on a free worker (holding one of `_slots`, given back at the end)."""
        assert self._slots is not None
        try:
            worker = self._idle.pop() if self._idle else await self._start()
            keep = False
            try:
                result = await worker.judge(request, self.deadline_s)
                keep = True
                return result
            except TimeoutError:
                return Judgement(error=f"no judgement within {self.deadline_s:g} s (the worker was stopped)")
            except (EOFError, ConnectionError, msgspec.DecodeError) as err:
                return Judgement(error=f"the worker failed ({err})")
            finally:
                if keep and worker.process.returncode is None:
                    self._idle.append(worker)
                else:  # its late answer must not reach the next request
                    self._all.discard(worker)
                    await asyncio.shield(worker.kill())
        finally:
            self._slots.release()

    async def _start(self) -> _Worker:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-P",  # not the script's folder on sys.path: this module would hide the library
            str(WORKER),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
        )
        worker = _Worker(process)
        self._all.add(worker)
        return worker

    async def aclose(self) -> None:
        jobs = list(self._jobs)
        for job in jobs:
            job.cancel()
        await asyncio.gather(*jobs, return_exceptions=True)
        for worker in list(self._all):
            await worker.kill()
        self._all.clear()
        self._idle.clear()
