"""Who holds the job up: one sentence from what every rank of a group last did.

Two ways in, one ``explain``:

- **Live**, when a collective passes its deadline (``diagnose``): each rank that timed out
  publishes where it waits through the job's store, gives the others a short grace to do the
  same, and adds the sentence to its ``CollectiveTimeoutError``. A rank that does not answer
  is stopped (``SIGSTOP``, a debugger) or busy outside shardline (a loop, a deadlock in its
  own code): no shardline thread of it can answer for it, so silence is the evidence.
- **After the fact**, from the flight recorder's dumps (``shardline why DIR``,
  ``explain_dumps``).

The sentence reads like "rank 2 never entered all_reduce #1533 (no answer from it: stopped,
or busy outside shardline); ranks 0, 1, 3 wait in it since 31 s".
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardline.comm import flight

_DUMP = re.compile(r"rank\d+\.json")  # a rank's dump, as the recorder names it

if TYPE_CHECKING:
    from shardline.comm.group import ProcessGroup

__all__ = ["Where", "describe_ops", "diagnose", "explain", "explain_dumps", "load_dumps"]


@dataclass(frozen=True)
class Where:
    """What one rank last did in a group: its last collective there and how it stands."""

    op: str
    seq: int
    since: float  # when it started (time.time())
    state: str  # "running", "done" or an error's class name

    def label(self) -> str:
        """``"all_reduce #1533"``."""
        return f"{self.op} #{self.seq}"


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, sorted(ranks)))


def explain(where: dict[int, Where | None], now: float, group: str = "world") -> str:
    """One sentence on who holds the group up.

    Args:
        where: For every rank of the group (by global rank), what it last did there; None
            for a rank that gave no answer (or left no record).
        now: The time the answers describe (``time.time()``).
        group: The group's name, said when it is not the whole job.
    """
    waiting = {r: w for r, w in where.items() if w is not None and w.state != "done"}
    if not waiting:
        return ""
    # The op the most ranks wait in (the furthest one when tied) is the one that hangs.
    counts = Counter((w.op, w.seq) for w in waiting.values())
    (op, seq), _ = max(counts.items(), key=lambda kv: (kv[1], kv[0][1]))
    stuck_in = sorted(r for r, w in waiting.items() if (w.op, w.seq) == (op, seq))
    longest = now - min(waiting[r].since for r in stuck_in)
    label = f"{op} #{seq}"
    parts: list[str] = []
    silent = sorted(r for r, w in where.items() if w is None)
    if silent:
        parts.append(
            f"{_ranks(silent)} never entered {label} (no answer from "
            f"{'it' if len(silent) == 1 else 'them'}: stopped, or busy outside shardline)"
        )
    for r, w in sorted(where.items()):
        if w is None or r in stuck_in:
            continue
        if w.state == "done" and w.seq < seq:
            parts.append(
                f"rank {r} never entered {label}: its last, {w.label()}, finished "
                f"{now - w.since:.0f} s ago (busy outside shardline since)"
            )
        elif w.seq == seq:
            parts.append(f"rank {r} waits in {w.label()} instead (the ranks call different ops)")
        else:
            parts.append(f"rank {r} waits in {w.label()} since {now - w.since:.0f} s")
    where_group = "" if group == "world" else f" of group {group!r}"
    parts.append(f"{_ranks(stuck_in)} wait in it{where_group} since {longest:.0f} s")
    return "; ".join(parts)


# -- live ---------------------------------------------------------------------------------------

_KEY = "shardline/why/{group}/{rank}"


def grace_for(timeout: float) -> float:
    """How long a rank that timed out waits for the others' answers.

    A tenth of the deadline, between 1 and 10 s: ranks reach their deadlines as far apart as
    they entered the op.
    """
    return min(max(1.0, timeout / 10), 10.0)


def diagnose(group: ProcessGroup, record: list[Any], store: Any, timeout: float) -> str:
    """The sentence for a collective of ``group`` that timed out here (see the module doc).

    Publishes this rank's answer under the group's key and reads the others' for up to
    ``grace_for(timeout)`` seconds. The store is asked from a helper thread: if its host is the
    stuck process, the question cannot hang this rank; the sentence then says so.
    """
    me = group.global_ranks[group.rank]
    mine = {"op": record[flight.OP], "seq": record[flight.SEQ], "since": record[flight.START],
            "state": "running"}  # fmt: skip
    answers: dict[int, Where | None] = dict.fromkeys(group.global_ranks)
    grace = grace_for(timeout)

    def ask() -> None:
        try:
            store.set(_KEY.format(group=group.name, rank=me), json.dumps(mine))
            deadline = time.monotonic() + grace
            while True:
                for r in group.global_ranks:
                    key = _KEY.format(group=group.name, rank=r)
                    if answers[r] is None and store.check([key]):
                        answers[r] = Where(**json.loads(bytes(store.get(key))))
                if all(a is not None for a in answers.values()) or time.monotonic() > deadline:
                    return
                time.sleep(0.05)
        except Exception:  # a store that fails is said below, as one that is silent
            return

    asker = threading.Thread(target=ask, name="shardline-why", daemon=True)
    asker.start()
    asker.join(grace + 5.0)
    if asker.is_alive() or answers[me] is None:
        return "(the job's store did not answer, so the other ranks could not be asked)"
    return explain(answers, time.time(), group.name)


# -- after the fact -----------------------------------------------------------------------------


def load_dumps(directory: Path) -> list[dict[str, Any]]:
    """Every ``rank<r>.json`` dump in ``directory``, by rank.

    Raises:
        ValueError: ``directory`` does not exist or is no folder, or a dump is unreadable.
    """
    if not directory.is_dir():
        what = "is not a folder" if directory.exists() else "does not exist"
        raise ValueError(
            f"{directory} {what}; pass the folder a failed op's error names (\"`shardline why "
            f"DIR` reads every rank's\"): each rank writes its rank<r>.json there when an op "
            f"fails or on SIGUSR1 (SHARDLINE_FLIGHT_DIR, by default "
            f"{flight.default_dir().parent}/<MASTER_ADDR>-<MASTER_PORT>)"
        )
    dumps = []
    # rank<r>.json only: a tracer's rank<r>.config.json and .now.json may share the folder
    for path in sorted(p for p in directory.glob("rank*.json") if _DUMP.fullmatch(p.name)):
        try:
            dump = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"{path} is not a flight-recorder dump ({exc})") from exc
        if not isinstance(dump, dict) or not {"rank", "ops", "time"} <= dump.keys():
            raise ValueError(
                f"{path} is not a flight-recorder dump (it lacks its rank, ops or time); "
                "remove it, or point `shardline why` at the folder the error named"
            )
        dumps.append(dump)
    return sorted(dumps, key=lambda d: d["rank"])


def explain_dumps(dumps: list[dict[str, Any]]) -> str:
    """The sentence for a job from its ranks' dumps (``shardline why``).

    The group explained is the one of the newest collective still running (or failed) on
    any rank; ranks of it with no dump count as silent.
    """
    if not dumps:
        return "no flight-recorder dumps here"
    unfinished = [
        (op[flight.START], op[flight.GROUP], d)
        for d in dumps
        for op in d["ops"]
        if op[flight.STATE] != "done" and op[flight.PEER] is None
    ]
    if not unfinished:
        return _not_finished(dumps)
    _, group, _ = max(unfinished, key=lambda u: u[0])
    members = next((d["groups"][group] for d in dumps if group in d.get("groups", {})), None)
    if members is None:
        members = list(range(int(dumps[0]["world_size"])))
    by_rank = {int(d["rank"]): d for d in dumps}
    where: dict[int, Where | None] = {}
    for r in members:
        d = by_rank.get(r)
        ops = [
            o
            for o in (d["ops"] if d else [])
            if o[flight.GROUP] == group and o[flight.PEER] is None
        ]
        last = ops[-1] if ops else None
        where[r] = (
            Where(last[flight.OP], last[flight.SEQ], last[flight.START], last[flight.STATE])
            if last is not None
            else None
        )
    now = max(float(d["time"]) for d in dumps)
    return explain(where, now, group) or _not_finished(dumps)


def _not_finished(dumps: list[dict[str, Any]]) -> str:
    """The sentence when no collective holds the job up: the ops that still had not finished.

    Point-to-point ops, and collectives that are not their rank's last in their group (one
    that failed, then later ones that finished), are named one by one.
    """
    now = max(float(d["time"]) for d in dumps)
    parts = []
    for d in dumps:
        for op in d["ops"]:
            if op[flight.STATE] == "done":
                continue
            label = f"{op[flight.OP]} #{op[flight.SEQ]}{_peer(op)}"
            if op[flight.STATE] == "running":
                parts.append(f"rank {d['rank']} waits in {label} since "
                             f"{now - op[flight.START]:.0f} s")  # fmt: skip
            else:
                parts.append(f"rank {d['rank']}'s {label} failed ({op[flight.STATE]})")
    if not parts:
        return "every recorded op finished: nothing was waiting when the dumps were written"
    many = len(parts) > 1
    return (
        f"no collective holds the job up, but {len(parts)} op{'s' if many else ''} "
        f"{'were' if many else 'was'} unfinished when the dumps were written: {'; '.join(parts)}"
    )


def _peer(op: list[Any]) -> str:
    """`` to rank 1`` / `` from rank 1`` / `` from any source`` for a point-to-point op."""
    peer = op[flight.PEER]
    if peer is None:
        return ""
    if peer == flight.ANY_SOURCE:
        return " from any source"
    return f" {'to' if op[flight.OP] == 'send' else 'from'} rank {peer}"


def describe_ops(dump: dict[str, Any], last: int) -> list[str]:
    """A dump's last ``last`` ops, one line each, times relative to the dump."""
    lines = []
    for op in dump["ops"][-last:]:
        peer = {None: "", flight.ANY_SOURCE: " from any source"}.get(
            op[flight.PEER], f" peer {op[flight.PEER]}"
        )
        took = (
            f"took {(op[flight.END] - op[flight.START]) * 1e3:.3f} ms"
            if op[flight.END] is not None
            else f"started {dump['time'] - op[flight.START]:.1f} s before the dump"
        )
        lines.append(
            f"{op[flight.GROUP]} {op[flight.OP]} #{op[flight.SEQ]}{peer}: "
            f"{op[flight.NUMEL]} x {op[flight.DTYPE] or '-'}, {took}, {op[flight.STATE]}"
        )
    return lines
