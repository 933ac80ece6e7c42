"""The run's timeline as Chrome trace-event JSON (`trace.json`), which the Perfetto UI opens.

Spans are complete events (`"ph": "X"`) on named tracks of one process: `trainer` (training
steps, with their micro-batches nested inside), `weight sync` (staging the weights out of the
trainer), `engine update` (the engine's critical section: pause, load, resume), `reward`
(scoring calls) and `generate N` (generation requests; concurrent requests get separate lanes,
a lane is reused once its request ends). Times are `time.monotonic()` seconds, written as
microseconds since the trace began.

The events live in a ring buffer: a long run keeps the newest `max_events` and notes how many
were dropped. This module records and writes; `rollflow.plots` reads the file back.
"""

from __future__ import annotations

import os
import time
from collections import deque
from pathlib import Path
from typing import Any

import msgspec

FIXED_TRACKS = ("trainer", "weight sync", "engine update", "reward")
"""Tracks shown first, in this order; generation lanes follow."""


class Trace:
    """Spans in a bounded buffer, written out as trace-event JSON."""

    def __init__(self, max_events: int = 200_000, *, began: float | None = None) -> None:
        self.began = time.monotonic() if began is None else began
        self._events: deque[dict[str, Any]] = deque(maxlen=max_events)
        self.recorded = 0
        self._tracks: dict[str, int] = {name: i + 1 for i, name in enumerate(FIXED_TRACKS)}
        self._free_lanes: list[int] = []
        self._lanes = 0

    @property
    def dropped(self) -> int:
        """Events that fell out of the ring buffer."""
        return self.recorded - len(self._events)

    def span(self, name: str, track: str, start: float, end: float, **args: Any) -> None:
        """One finished span on `track`, from `start` to `end` (monotonic seconds)."""
        if track not in self._tracks:
            self._tracks[track] = len(self._tracks) + 1
        self._events.append(
            {
                "name": name,
                "ph": "X",
                "ts": round((start - self.began) * 1e6, 1),
                "dur": round(max(end - start, 0.0) * 1e6, 1),
                "pid": 1,
                "tid": self._tracks[track],
                "args": args,
            }
        )
        self.recorded += 1

    def lane(self) -> str:
        """A generation lane no running request holds; give it back with `release`."""
        if self._free_lanes:
            index = min(self._free_lanes)
            self._free_lanes.remove(index)
        else:
            index = self._lanes
            self._lanes += 1
        return f"generate {index}"

    def release(self, lane: str) -> None:
        self._free_lanes.append(int(lane.rsplit(" ", 1)[1]))

    def to_json(self) -> dict[str, Any]:
        metadata: list[dict[str, Any]] = [
            {"name": "process_name", "ph": "M", "pid": 1, "tid": 0, "args": {"name": "rollflow"}}
        ]
        for name, tid in self._tracks.items():
            metadata.append({"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": name}})
            metadata.append({"name": "thread_sort_index", "ph": "M", "pid": 1, "tid": tid, "args": {"sort_index": tid}})
        return {
            "traceEvents": metadata + list(self._events),
            "displayTimeUnit": "ms",
            "otherData": {"recorded_events": self.recorded, "dropped_events": self.dropped},
        }

    def write(self, path: str | Path) -> None:
        """Write the trace atomically (a reader never sees half a file)."""
        path = Path(path)
        staging = path.with_name(f".{path.name}.tmp")
        staging.write_bytes(msgspec.json.encode(self.to_json()))
        os.replace(staging, path)


def load_trace(path: str | Path) -> dict[str, Any]:
    """Read a `trace.json`; spans are returned with `track` names and times in seconds."""
    path = Path(path)
    try:
        data = msgspec.json.decode(path.read_bytes())
    except (OSError, msgspec.DecodeError) as err:
        raise ValueError(f"{path}: not a readable trace-event JSON file ({err})") from None
    events = data.get("traceEvents") if isinstance(data, dict) else None
    if not isinstance(events, list):
        raise ValueError(f"{path}: expected an object with a `traceEvents` list")
    names = {e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}
    spans = [
        {
            "name": e["name"],
            "track": names.get(e["tid"], str(e["tid"])),
            "start": e["ts"] / 1e6,
            "end": (e["ts"] + e["dur"]) / 1e6,
            "args": e.get("args", {}),
        }
        for e in events
        if e.get("ph") == "X"
    ]
    return {"spans": spans, "other": data.get("otherData", {})}
