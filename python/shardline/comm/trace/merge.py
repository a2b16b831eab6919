"""``shardline trace merge``: every rank's timeline as one Chrome/Perfetto trace.

Open the JSON in https://ui.perfetto.dev or ``chrome://tracing``: one process per rank
(``rank 3 (host)``), one track per group for its collectives, one for point-to-point
messages, one for optimizer steps and one for the program's spans. An op timed on its GPU
(NCCL) also shows on a ``gpu <group>`` track at the time it ran there; its host track shows
when the program queued it. An op's arguments say its size, dtype, peer, how it ended and the
``file:line`` that issued it. Times are each rank's wall clock, shown from the earliest event
of the job.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from shardline.comm import flight
from shardline.comm.trace.folder import device_span, load

__all__ = ["chrome_trace", "merge"]


def chrome_trace(directory: str | Path) -> dict[str, Any]:
    """The Chrome trace-event document of the job traced into ``directory``."""
    ranks = load(directory)
    starts = [float(o[flight.START]) for r in ranks.values() for o in r.ops]
    starts += [float(e["t0"]) for r in ranks.values() for e in r.steps + r.spans]
    origin = min(starts, default=0.0)

    def us(t: float) -> float:
        return round((t - origin) * 1e6, 3)

    events: list[dict[str, Any]] = []
    for r, rank in sorted(ranks.items()):
        host = rank.config.get("host", "")
        events.append(
            {
                "ph": "M",
                "name": "process_name",
                "pid": r,
                "args": {"name": f"rank {r}" + (f" ({host})" if host else "")},
            }
        )
        events.append({"ph": "M", "name": "process_sort_index", "pid": r,
                       "args": {"sort_index": r}})  # fmt: skip
        for o in rank.ops:
            p2p = o[flight.PEER] is not None
            track = "p2p" if p2p else f"comm {o[flight.GROUP]}"
            args = {
                "group": o[flight.GROUP], "numel": o[flight.NUMEL], "dtype": o[flight.DTYPE],
                "peer": o[flight.PEER], "state": o[flight.STATE],
                "where": o[flight.WHERE] if len(o) > flight.WHERE else None,
            }  # fmt: skip
            name = f"{o[flight.OP]} #{o[flight.SEQ]}"
            events.append({
                "ph": "X", "pid": r, "tid": track, "cat": "comm", "name": name,
                "ts": us(float(o[flight.START])),
                "dur": us(float(o[flight.END])) - us(float(o[flight.START])), "args": args,
            })  # fmt: skip
            on_device = device_span(o)
            if on_device is not None:
                events.append({
                    "ph": "X", "pid": r, "tid": f"gpu {track}", "cat": "gpu", "name": name,
                    "ts": us(on_device[0]), "dur": us(on_device[1]) - us(on_device[0]),
                    "args": args,
                })  # fmt: skip
        for e in rank.steps:
            events.append({"ph": "X", "pid": r, "tid": "optimizer", "cat": "step",
                           "name": f"step {e['n']}", "ts": us(float(e["t0"])),
                           "dur": us(float(e["t1"])) - us(float(e["t0"]))})  # fmt: skip
        for e in rank.spans:
            events.append({"ph": "X", "pid": r, "tid": "spans", "cat": "compute",
                           "name": e["name"], "ts": us(float(e["t0"])),
                           "dur": us(float(e["t1"])) - us(float(e["t0"])),
                           "args": {"where": e.get("where")}})  # fmt: skip
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def merge(directory: str | Path, out: str | Path | None = None) -> Path:
    """Writes the merged trace (``DIR/trace.json`` by default) and returns its path."""
    path = Path(out) if out is not None else Path(directory) / "trace.json"
    path.write_text(json.dumps(chrome_trace(directory)))
    return path
