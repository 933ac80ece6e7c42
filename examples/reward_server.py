"""A reference reward server for rollflow's remote rewards, on aiohttp.web.

    python examples/reward_server.py --port 8000                 # binds 127.0.0.1
    python -m rollflow train --preset tiny --output-dir runs/remote \\
        --set 'scoring.rewards=[{name="arith", url="http://127.0.0.1:8000/score"}]' --set data.task=arithmetic

`POST /score` takes `{"prompts": [str], "completions": [str], "answer": [str | null], ...}` and
answers `{"rewards": [number | null]}`: 1.0 when the completion's last number equals the answer,
0.0 when it does not, null when the completion has no number. Bad input gets HTTP 400 with
`{"error": reason}`. With `--token-env NAME`, requests must carry `Authorization: Bearer
$NAME`. `GET /health` answers `ok`.
"""

from __future__ import annotations

import argparse
import os
import re
from typing import Any

from aiohttp import web

MAX_ITEMS = 4096
NUMBER = re.compile(r"-?\d+")


def score(completion: str, answer: Any) -> float | None:
    numbers = NUMBER.findall(completion)
    if not numbers or answer is None:
        return None
    return 1.0 if numbers[-1] == str(answer).strip() else 0.0


def validate(body: Any) -> tuple[list[str], list[Any]]:
    """(completions, answers), or ValueError naming what is wrong."""
    if not isinstance(body, dict):
        raise ValueError("expected a JSON object")
    prompts, completions = body.get("prompts"), body.get("completions")
    for name, value in (("prompts", prompts), ("completions", completions)):
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ValueError(f"`{name}` must be a list of strings")
    assert isinstance(prompts, list) and isinstance(completions, list)
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
    if len(completions) > MAX_ITEMS:
        raise ValueError(f"at most {MAX_ITEMS} completions per request")
    answers = body.get("answer", [None] * len(completions))
    if not isinstance(answers, list) or len(answers) != len(completions):
        raise ValueError("`answer` must be a list with one entry per completion")
    return completions, answers


def make_app(token: str | None = None) -> web.Application:
    async def handle(request: web.Request) -> web.Response:
        if token is not None and request.headers.get("Authorization") != f"Bearer {token}":
            return web.json_response({"error": "missing or wrong bearer token"}, status=401)
        try:
            body = await request.json()
        except ValueError:
            return web.json_response({"error": "the body is not JSON"}, status=400)
        try:
            completions, answers = validate(body)
        except ValueError as err:
            return web.json_response({"error": str(err)}, status=400)
        return web.json_response({"rewards": [score(c, a) for c, a in zip(completions, answers, strict=True)]})

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application(client_max_size=16 * 1024 * 1024)
    app.router.add_post("/score", handle)
    app.router.add_get("/health", health)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--token-env", default="", help="environment variable holding the bearer token to require")
    args = parser.parse_args()
    token = os.environ.get(args.token_env) if args.token_env else None
    if args.token_env and not token:
        parser.error(f"environment variable {args.token_env} is not set")
    web.run_app(make_app(token), host=args.host, port=args.port)


if __name__ == "__main__":
    main()
