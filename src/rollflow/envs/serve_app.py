"""Serve an ASGI app with uvicorn for as long as the process that started it lives.

Run as a script (`python -P serve_app.py module:app --host ... --port ...`, uvicorn's own
arguments) by `rollflow.envs.openenv` when a run serves an OpenEnv environment itself. A thread
watches the parent process: when it is gone (the run ended, even by SIGKILL, which runs no
cleanup), this process exits, so no server outlives its run. It imports only uvicorn and the app,
not rollflow (run as a file, with `-P`, so that `rollflow/envs/openenv.py` does not hide the
`openenv` package the app imports).
"""

from __future__ import annotations

import os
import sys
import threading
import time

WATCH_S = 0.5
"""How often the parent is checked."""


def watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(WATCH_S)
    os._exit(0)  # the parent is gone: nothing here is worth a graceful shutdown


def main() -> None:
    threading.Thread(target=watch_parent, args=(os.getppid(),), name="watch-parent", daemon=True).start()
    import uvicorn

    sys.argv[0] = "uvicorn"
    uvicorn.main()


if __name__ == "__main__":
    main()
