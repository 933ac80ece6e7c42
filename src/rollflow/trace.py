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

import heapq
import os
import time
from collections import deque
from pathlib import Path
from typing import Any

import msgspec

FIXED_TRACKS = ("trainer", "weight sync", "engine update", "reward")
"""Tracks shown first, in this order; generation lanes follow."""

LANE_BASE = 1000
"""Track id of generation lane 0 (named tracks take the ids below it)."""


class Trace:
    """Spans in a bounded buffer, written out as trace-event JSON."""

    def __init__(self, max_events: int = 200_000, *, began: float | None = None) -> None:
        self.began = time.monotonic() if began is None else began
        # (name, track id, start, end, args): cheap to append; turned into JSON only on write.
        self._events: deque[tuple[str, int, float, float, dict[str, Any]]] = deque(maxlen=max_events)
        self.recorded = 0
        self._tracks: dict[str, int] = {name: i + 1 for i, name in enumerate(FIXED_TRACKS)}
        self._free_lanes: list[int] = []
        self._lanes = 0

    @property
    def dropped(self) -> int:
        """Events that fell out of the ring buffer."""
        return self.recorded - len(self._events)

    def span(self, name: str, track: str | int, start: float, end: float, **args: Any) -> None:
        """One finished span on `track` (a name, or a generation lane from `lane`), from `start`
        to `end` (seconds of the clock `began` is on)."""
        if isinstance(track, int):
            tid = LANE_BASE + track
        else:
            tid = self._tracks.get(track, 0)
            if not tid:
                tid = self._tracks[track] = len(self._tracks) + 1
        self._events.append((name, tid, start, end, args))
        self.recorded += 1

    def lane(self) -> int:
        """The lowest generation lane (track `generate N`) no running request holds; give it back
        with `release`."""
        if self._free_lanes:
            return heapq.heappop(self._free_lanes)
        self._lanes += 1
        return self._lanes - 1

    def release(self, lane: int) -> None:
        heapq.heappush(self._free_lanes, lane)

    def to_json(self) -> dict[str, Any]:
        metadata: list[dict[str, Any]] = [
            {"name": "process_name", "ph": "M", "pid": 1, "tid": 0, "args": {"name": "rollflow"}}
        ]
        tracks = {**self._tracks, **{f"generate {i}": LANE_BASE + i for i in range(self._lanes)}}
        for name, tid in tracks.items():
            metadata.append({"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": name}})
            metadata.append({"name": "thread_sort_index", "ph": "M", "pid": 1, "tid": tid, "args": {"sort_index": tid}})
        spans = [
            {
                "name": name,
                "ph": "X",
                "ts": round((start - self.began) * 1e6, 1),
                "dur": round(max(end - start, 0.0) * 1e6, 1),
                "pid": 1,
                "tid": tid,
                "args": args,
            }
            for name, tid, start, end, args in self._events
        ]
        return {
            "traceEvents": metadata + spans,
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
