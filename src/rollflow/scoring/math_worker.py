"""A math-verify worker process: one JSON request per line in, one judgement per line out.

Run as a script by `rollflow.scoring.math_verify` (not as `-m rollflow...`, which would import
rollflow and torch: seconds and hundreds of MB per worker). It imports only msgspec and
math-verify, and works on its main thread, where math-verify's own timeouts (SIGALRM) work. A
request is `{"gold": ..., "text": ..., "timeout_s": N}`; the answer `{"value": 1.0 | 0.0}`, or
`{"error": "why"}` when the completion cannot be judged (a timeout, a reference answer
math-verify cannot parse). It exits when its input closes (its parent is gone).
"""

from __future__ import annotations

import logging
import re
import sys
from collections import OrderedDict
from typing import Any

import msgspec
from math_verify import parse, verify
from math_verify.errors import TimeoutException


class Request(msgspec.Struct, frozen=True):
    gold: str
    text: str
    timeout_s: int


class Judgement(msgspec.Struct, frozen=True, omit_defaults=True):
    value: float | None = None
    error: str | None = None


GOLDS_KEPT = 1024
"""Reference answers kept parsed (a group's samples share one)."""

_golds: OrderedDict[tuple[str, int], Any] = OrderedDict()

_WORDS = re.compile(r"[A-Za-z][A-Za-z .,;:'!?-]*")
_WORD = re.compile(r"[A-Za-z]{2,}")


def gold_of(text: str, timeout_s: int) -> Any:
    """The reference answer parsed, or a Judgement saying why it cannot be compared with. What
    is settled (a parse, an answer that is not math) is kept; a timeout is not, since the next
    try may finish in time."""
    key = (text, timeout_s)
    if key in _golds:
        _golds.move_to_end(key)
        return _golds[key]
    found = _parse_gold(text, timeout_s)
    if not (isinstance(found, Judgement) and found.error is not None and found.error.startswith("timed out")):
        _golds[key] = found
        while len(_golds) > GOLDS_KEPT:
            _golds.popitem(last=False)
    return found


def _parse_gold(text: str, timeout_s: int) -> Any:
    """A row's answer is the answer itself, read as one expression (`$answer$`) unless it has its
    own delimiters: so `\\{1, 2\\}` is a set and `(1, 2)` an interval, not the numbers in them.
    Undelimited words (`Paris`, `yes`) are not math: math-verify would read them as products of
    one-letter symbols, and every completion would score 0."""
    delimited = "$" in text or "\\boxed" in text or "\\(" in text or "\\[" in text
    if not delimited and _WORDS.fullmatch(text.strip()) and _WORD.search(text):
        return Judgement(
            error=f"the answer {text[:60]!r} is not math (math-verify would read its words as products of "
            "symbols); score text answers with another reward, or write math answers in LaTeX ($...$)"
        )
    try:
        parsed = [] if delimited else parse(f"${text}$", parsing_timeout=timeout_s, raise_on_error=True)
        if not parsed:
            parsed = parse(text, parsing_timeout=timeout_s, raise_on_error=True)
    except TimeoutException:
        return Judgement(error=f"timed out after {timeout_s} s parsing the answer {text[:60]!r}")
    except Exception as err:
        return Judgement(error=f"cannot parse the answer {text[:60]!r} ({type(err).__name__})")
    if not parsed:
        return Judgement(error=f"math-verify finds no math in the answer {text[:60]!r}")
    return parsed


def judge(request: Request) -> Judgement:
    gold = gold_of(request.gold, request.timeout_s)
    if isinstance(gold, Judgement):
        return gold
    try:
        answer = parse(request.text, parsing_timeout=request.timeout_s, raise_on_error=True)
    except TimeoutException:
        return Judgement(error=f"timed out after {request.timeout_s} s parsing the completion")
    except Exception:  # nothing math-verify can read: no answer, so not correct
        return Judgement(value=0.0)
    if not answer:
        return Judgement(value=0.0)
    try:
        same = verify(gold, answer, timeout_seconds=request.timeout_s, raise_on_error=True)
    except TimeoutException:
        return Judgement(error=f"timed out after {request.timeout_s} s comparing the answers")
    except Exception:  # math-verify's own rule: a comparison that fails is not a match
        return Judgement(value=0.0)
    return Judgement(value=1.0 if same else 0.0)


def main() -> None:
    logging.disable(logging.WARNING)  # math-verify logs every timeout; the judgement says it
    decoder = msgspec.json.Decoder(Request)
    encoder = msgspec.json.Encoder()
    for line in sys.stdin.buffer:
        try:
            result = judge(decoder.decode(line))
        except msgspec.DecodeError as err:
            result = Judgement(error=f"bad request ({err})")
        sys.stdout.buffer.write(encoder.encode(result) + b"\n")
        sys.stdout.buffer.flush()


if __name__ == "__main__":
    main()
