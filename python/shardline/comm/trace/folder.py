"""Reading a trace folder (``recorder``'s files): every rank's settings, heartbeat and events."""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardline.comm import flight
from shardline.errors import InvalidArgumentError

__all__ = [
    "DEVICE_END",
    "DEVICE_START",
    "Rank",
    "device_span",
    "load",
    "newest_world",
    "read_object",
    "span",
]

# An op timed on its GPU: its record carries its device start and end (wall clock) here.
DEVICE_START, DEVICE_END = 10, 11

_FILE = re.compile(r"rank(\d+)\.(config\.json|now\.json|trace\.jsonl)$")


@dataclass
class Rank:
    """What one rank left in the folder; a part it never wrote is empty."""

    rank: int
    config: dict[str, Any] = field(default_factory=dict)
    now: dict[str, Any] = field(default_factory=dict)  # the last heartbeat
    ops: list[list[Any]] = field(default_factory=list)  # finished ops, flight records
    steps: list[dict[str, Any]] = field(default_factory=list)
    spans: list[dict[str, Any]] = field(default_factory=list)
    # Its settings or heartbeat file that could not be read (cut short by a crash): read as
    # missing, and said, rather than the whole folder refused
    unreadable: list[str] = field(default_factory=list)


def load(
    directory: str | Path, notes: list[str] | None = None, *, tail: int | None = None
) -> dict[int, Rank]:
    """Every rank's files in ``directory``, by rank.

    Only the newest run's ranks: a folder traced again by a job of fewer ranks (or an
    elastic job's later, smaller generation) still holds the earlier run's higher ranks;
    they are left out and said in ``notes`` (when given). With ``tail``, only the last
    ``tail`` bytes of a longer timeline are read (its recent history), and said in ``notes``.

    Raises:
        InvalidArgumentError: no such folder, no rank's file in it, or a timeline that is
            not what the tracer writes (named, with what to do). A settings or heartbeat file
            that cannot be read is left empty and named in ``Rank.unreadable``.
    """
    path = Path(directory)
    if not path.is_dir():
        raise InvalidArgumentError(
            f"{path} is not a folder; pass the folder the job traced into (SHARDLINE_TRACE)"
        )
    ranks: dict[int, Rank] = {}
    cut: list[int] = []
    for file in sorted(path.iterdir()):
        m = _FILE.match(file.name)
        if m is None:
            continue
        r = int(m.group(1))
        rank = ranks.setdefault(r, Rank(r))
        if m.group(2) != "trace.jsonl":
            try:
                value = read_object(file)
            except (OSError, ValueError) as exc:
                rank.unreadable.append(f"{file.name} ({exc})")
                continue
            if m.group(2) == "config.json":
                rank.config = value
            else:
                rank.now = value
            continue
        try:
            if _events(file, rank, tail):
                cut.append(r)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise InvalidArgumentError(
                f"{file} is not a shardline trace file ({exc}); remove it or trace again"
            ) from exc
    if not ranks:
        raise InvalidArgumentError(
            f"{path} holds no rank's trace (rank<r>.config.json, .now.json, .trace.jsonl); was "
            "the job started with SHARDLINE_TRACE set to it?"
        )
    notes = notes if notes is not None else []
    ranks = _newest_run(ranks, notes)
    if cut := [r for r in cut if r in ranks]:
        notes.append(
            f"the timeline{'s' if len(cut) > 1 else ''} of rank{'s' if len(cut) > 1 else ''} "
            f"{', '.join(map(str, cut))}: only the last {(tail or 0) / 2**20:g} MiB read, "
            "older ops not checked"
        )
    return ranks


def read_object(file: Path) -> dict[str, Any]:
    """A settings or heartbeat file's JSON object.

    Raises:
        OSError: it cannot be read.
        ValueError: it is not JSON, or not an object (cut short, say).
    """
    value = json.loads(file.read_text())
    if not isinstance(value, dict):
        raise ValueError(f"a JSON {type(value).__name__}, not an object")
    return value


def _newest_config(ranks: dict[int, Rank]) -> dict[str, Any]:
    """The settings of the rank that started tracing last: ``{}`` if none says when."""
    started = [r.config for r in ranks.values() if _number(r.config.get("started"))]
    return max(started, key=lambda c: float(c["started"]), default={})


def newest_world(ranks: dict[int, Rank]) -> int:
    """The newest run's world size, or 0 where no settings file gives one.

    Where none says when it started (an earlier tracer's files), the largest any gives.
    """
    newest = _newest_config(ranks)
    configs = [newest] if newest else [r.config for r in ranks.values()]
    worlds = [w for c in configs if isinstance(w := c.get("world_size"), int) and _number(w)]
    return max((w for w in worlds if w >= 1), default=0)


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _newest_run(ranks: dict[int, Rank], notes: list[str]) -> dict[int, Rank]:
    """The ranks of the run whose rank started tracing last: below its world size."""
    newest, world = _newest_config(ranks), newest_world(ranks)
    if not newest or not world:
        return ranks
    earlier = sorted(r for r in ranks if r >= world)
    for r in earlier:
        notes.append(
            f"rank{r}.* left out: the newest run (rank {newest.get('rank')} started "
            f"{time.strftime('%H:%M:%S', time.localtime(newest['started']))}) has {world} "
            f"rank{'s' if world != 1 else ''}: these are an earlier run's (or generation's)"
        )
    return {r: v for r, v in ranks.items() if r < world}


def _events(file: Path, rank: Rank, tail: int | None) -> bool:
    """Reads ``file``'s events into ``rank`` (its last ``tail`` bytes); whether it cut."""
    with open(file, "rb") as f:
        size, cut = os.fstat(f.fileno()).st_size, False
        if tail is not None and size > tail:
            f.seek(size - tail)
            cut = True
        data = f.read()
    if cut:
        data = data[data.find(b"\n") + 1 :]  # from the first whole line on
    text = data.decode("utf-8")
    lines = text.split("\n")
    if lines and lines[-1] and not text.endswith("\n"):
        lines = lines[:-1]  # a line being written as we read
    for line in lines:
        if not line:
            continue
        event = json.loads(line)
        kind = event["k"]
        if kind == "ops":
            rank.ops += event["r"]
        elif kind == "op":  # one op a line: traces of earlier versions
            record = event["r"]
            if "d" in event:
                record = record + [None] * (DEVICE_START - len(record)) + list(event["d"])
            rank.ops.append(record)
        elif kind == "step":
            rank.steps.append(event)
        elif kind == "span":
            rank.spans.append(event)
    return cut


def device_span(op: list[Any]) -> tuple[float, float] | None:
    """When a loaded op ran on its GPU (wall clock), or ``None`` for one not timed there."""
    if len(op) > DEVICE_END and op[DEVICE_START] is not None:
        return float(op[DEVICE_START]), float(op[DEVICE_END])
    return None


def span(op: list[Any]) -> tuple[float, float]:
    """When a loaded op took place: on its GPU where it was timed there, else on the host."""
    return device_span(op) or (float(op[flight.START]), float(op[flight.END]))
