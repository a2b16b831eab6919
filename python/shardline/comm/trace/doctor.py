"""``shardline doctor``: what holds a job up, read from its trace folder, live or after the end.

Four checks, each a finding that names the rank:

- **hang**: a collective that some ranks of its group wait in for longer than ``hang_after``
  seconds while others are not in it. Each of those others is named with why: gone (its
  process no longer exists), silent (its heartbeat stopped: stopped, or stuck in native
  code holding the GIL), in another op (which, where), behind, or busy outside shardline at
  the program's ``file:line``. The waiting ranks' op comes with its number and the line
  that issued it.
- **mismatch**: ranks that called different ops, or the same op on different sizes, under
  one number of one group (a wrong op order).
- **straggler**: over the last ``steps`` optimizer steps, a rank whose time outside
  communication per step (the lower quartile of those steps) exceeds the median rank's by
  ``slower`` or more (the others then wait for it inside every collective). A rank's own
  clock measures its own gaps, so clocks of different hosts need not agree. Where NCCL ops
  were timed on the GPU on one step in N (``SHARDLINE_TRACE_GPU=N``), the last ``steps`` of
  those steps.
- **settings**: versions, ``SHARDLINE_*`` settings and the program's notes
  (``shardline.trace.note``; ``distribute`` notes its strategy) that differ between ranks.

A live job's heartbeats are at most one interval old, so the doctor answers within a
second or two of being asked (``diagnose`` on a job timed on its GPUs on some steps only
first waits for the steps it asks for, where nothing hangs). A heartbeat that looks older
is read again an interval and a half later before its rank is called silent: still beating,
it comes from a host whose clock is behind the doctor's (said in the report's notes), and
the rank is alive.
"""

from __future__ import annotations

import itertools
import os
import socket
import statistics
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardline.comm import flight
from shardline.comm.trace import ask
from shardline.comm.trace.folder import Rank, load, newest_world, read_object, span

__all__ = ["Finding", "Report", "diagnose", "examine"]

# Settings that differ between ranks by design: never a finding.
PER_RANK = {
    "SHARDLINE_HOST_ID", "SHARDLINE_BIND_ADDR", "SHARDLINE_ELASTIC_SLOT",
    "SHARDLINE_ELASTIC_INCARNATION", "SHARDLINE_ELASTIC_STANDBY", "SHARDLINE_PROGRESS",
}  # fmt: skip


MIN_STEPS = 5  # fewer steps say nothing about a straggler
MIN_EXCESS = 5e-4  # seconds per step: less is noise, whatever the ratio
# A rank's timeline is read from its last this many bytes (some 70,000 ops): its recent
# history, where a hang, a straggler's last steps and a mismatch (the engine raises at the
# first) are. A long job's whole timeline (4 ranks of 200,000 ops, 23 MB each) took 5.0 s
# and 630 MB to read and check on the 2-core VM, its last 8 MiB 1.8 s and 220 MB.
HISTORY_BYTES = 8 << 20


@dataclass(frozen=True)
class Finding:
    """One problem: its kind, the ranks it blames, and the sentence that says it."""

    kind: str  # "hang", "mismatch", "straggler", "settings", "silent"
    ranks: tuple[int, ...]
    text: str


@dataclass
class Report:
    """What ``examine`` found in a trace folder."""

    ranks: int
    live: bool  # a heartbeat is fresh: the job runs
    steps: int  # the most optimizer steps a rank reported
    findings: list[Finding] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # files read as missing or left out, why
    running: list[int] = field(default_factory=list)  # the ranks alive and beating
    # GPU times were taken on some steps only (``SHARDLINE_TRACE_GPU=N``, N > 1)
    sampled: bool = False

    def culprits(self, kind: str) -> set[int]:
        """The ranks blamed by findings of ``kind``."""
        return {r for f in self.findings if f.kind == kind for r in f.ranks}

    def text(self) -> str:
        """The report as the command prints it."""
        head = (
            f"{self.ranks} rank{'s' if self.ranks != 1 else ''} traced, "
            f"{'running' if self.live else 'not running'}, {self.steps} steps"
        )
        notes = "".join(f"\n({n})" for n in self.notes)
        if not self.findings:
            return f"{head}: no hang, no straggler, no mismatch; settings agree{notes}"
        return head + ":\n" + "\n".join(f"- {f.kind}: {f.text}" for f in self.findings) + notes


def examine(
    directory: str | Path,
    *,
    steps: int = 20,
    slower: float = 0.07,
    hang_after: float = 2.0,
    history: int | None = HISTORY_BYTES,
    now: float | None = None,
) -> Report:
    """Reads ``directory`` (a job's ``SHARDLINE_TRACE``) and says what is wrong.

    Args:
        directory: The folder the job traced into.
        steps: The straggler check's window: the last this many optimizer steps.
        slower: A rank is a straggler when its time outside communication per step is at
            least ``1 + slower`` times the median rank's.
        hang_after: Seconds the waiting ranks must have waited before a hang is called.
        history: Bytes read from the end of each rank's timeline (``None``: all of it).
        now: The time to judge heartbeats by; the clock by default.
    """
    notes: list[str] = []
    ranks = load(directory, notes, tail=history)
    clock = now is None
    now = time.time() if now is None else now
    interval = max((float(r.now.get("interval", 1.0)) for r in ranks.values() if r.now),
                   default=1.0)  # fmt: skip
    stale = 2.5 * interval + 1.0
    if clock:
        # A heartbeat that looks stale by this clock may still be beating, on a host whose
        # clock is behind this one's. Where one looks stale, it is read again an interval
        # and a half later: one that moved on and is still as stale by this clock is alive,
        # and judged by this clock from now on. One that moved on and is fresh was only
        # late (a busy host): it is judged as first read, with the other ranks' heartbeats
        # (one snapshot of them all).
        old = {r: float(x.now["time"]) for r, x in ranks.items()
               if x.now and x.now.get("state") == "running"
               and now - float(x.now["time"]) > stale}  # fmt: skip
        if old:
            time.sleep(min(1.5 * interval + 0.2, 3.0))
            for r, seen in old.items():
                beat = _heartbeat(Path(directory), r)
                if beat is None or float(beat["time"]) <= seen:
                    continue  # not beating (or unreadable now): as first read
                behind = time.time() - float(beat["time"])
                if behind > stale:
                    ranks[r].now = {**beat, "time": now}
                    notes.append(
                        f"rank {r}'s heartbeat reads {behind:.0f} s old by this host's clock "
                        f"but still beats: its host's clock is some {behind:.0f} s behind "
                        "(read as alive; the times it wrote are that much early)"
                    )
    beats = [float(r.now["time"]) for r in ranks.values() if r.now]
    live = any(now - t <= stale and r.now.get("state") == "running"
               for r in ranks.values() for t in [float(r.now.get("time", 0))] if r.now)  # fmt: skip
    ref = now if live else max(beats, default=now)  # a finished job: as its last heartbeat saw
    world = newest_world(ranks)  # ``load`` left out other runs' ranks
    report = Report(ranks=max(world, len(ranks)), live=live,
                    steps=max((int(r.steps[-1]["n"]) + 1 for r in ranks.values() if r.steps),
                              default=0),
                    notes=[f"unreadable, read as missing: {n}" for r in ranks.values()
                           for n in r.unreadable] + notes)  # fmt: skip
    # A job that runs no more: a rank whose heartbeat still says "running" ended unannounced.
    state = {r: _state(ranks.get(r), ref, stale if live else -1.0) for r in range(report.ranks)}
    report.running = [r for r, s in state.items() if s["kind"] == "running"]
    report.live = live = bool(report.running)
    report.sampled = any(m.get("gpu") is False for r in ranks.values() for m in r.steps)
    report.findings += _hang(ranks, state, ref, hang_after)
    report.findings += _mismatch(ranks)
    report.findings += _straggler(ranks, steps, slower)
    report.findings += _settings(ranks)
    if not any(f.kind == "hang" for f in report.findings):
        for r, s in state.items():
            if s["kind"] in ("gone", "silent", "missing"):
                report.findings.append(Finding("silent", (r,), f"rank {r} {s['text']}"))
    return report


def diagnose(
    directory: str | Path,
    *,
    steps: int = 20,
    slower: float = 0.07,
    hang_after: float = 2.0,
    history: int | None = HISTORY_BYTES,
    wait: float = 60.0,
) -> Report:
    """``examine``, but a live job timed on its GPUs on some steps only is asked first.

    Where nothing hangs, such a job's ranks are asked for GPU times on their next ``steps``
    steps (``ask``), and the folder is read again once they have written them, or after
    ``wait`` seconds (0: never ask). The report's notes say which. The other arguments are
    ``examine``'s.
    """
    report = examine(directory, steps=steps, slower=slower, hang_after=hang_after,
                     history=history)  # fmt: skip
    if wait <= 0 or not report.sampled or not report.running or report.culprits("hang"):
        return report
    t0 = time.monotonic()
    try:
        rid = ask.ask(directory, steps)
    except OSError as exc:  # a folder this user may read but not write
        report.notes.append(f"could not ask the job for GPU times on every step: {exc}")
        return report
    answered, late = ask.wait(directory, rid, report.running, wait)
    again = examine(directory, steps=steps, slower=slower, hang_after=hang_after,
                    history=history)  # fmt: skip
    took = time.monotonic() - t0
    if late:
        again.notes.append(
            f"asked for GPU times on every step; {_ranks(late)} did not write {steps} such "
            f"steps within {wait:g} s (the straggler check read the steps timed as sampled; "
            "--wait sets how long to wait)"
        )
    elif answered:
        again.notes.append(
            f"GPU times on every step of the last {steps}, asked of the job: {took:.1f} s"
        )
    return again


# -- each rank's state ---------------------------------------------------------------------------


def _heartbeat(directory: Path, r: int) -> dict[str, Any] | None:
    """Rank ``r``'s heartbeat read now; ``None`` where it cannot be read or has no time."""
    try:
        beat = read_object(directory / f"rank{r}.now.json")
        float(beat["time"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return beat


def _label(op: list[Any]) -> str:
    group = "" if op[flight.GROUP] == "world" else f" of group {op[flight.GROUP]!r}"
    return f"{op[flight.OP]} #{op[flight.SEQ]}{group}"


def _at(op: list[Any]) -> str:
    where = op[flight.WHERE] if len(op) > flight.WHERE else None
    return f" (issued at {where})" if where else ""


def _alive(pid: int, host: str) -> bool | None:
    """Whether process ``pid`` of ``host`` exists; None when it is another host's."""
    if host != socket.gethostname():
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _state(rank: Rank | None, ref: float, stale: float) -> dict[str, Any]:
    """How a rank stands: its kind, its running ops, and a phrase for it.

    The kind is "running", "gone", "silent", "exited" or "missing".
    """
    if rank is None or not rank.now:
        return {"kind": "missing", "running": [], "text": "left no heartbeat (was it traced?)"}
    now = rank.now
    running = [op for op in now.get("running", []) if op[flight.END] is None]
    last = rank.ops[-1] if rank.ops else None
    after = f"; its last op, {_label(last)}, finished{_at(last)}" if last else ""
    beat = float(now["time"])
    if now.get("state") in ("shutdown", "exited"):
        how = "shut down" if now["state"] == "shutdown" else "exited without shutdown"
        return {"kind": "exited", "running": running, "time": beat, "text": f"{how}{after}"}
    age = ref - beat
    alive = _alive(int(now.get("pid", -1)), str(now.get("host", "")))
    main = next((t for t in now.get("threads", []) if t.get("main")), None)
    where = main.get("where") if main else None
    if age > stale or alive is False:
        # Where its last heartbeat saw it: a job killed as a whole (a time limit, SIGKILL)
        # leaves every rank gone, and this says where each one was.
        fn = f" (in {main['function']})" if main and main.get("function") else ""
        was = f"; at its last heartbeat it ran {where}{fn}" if where and not running else ""
        if alive is False:
            text = (f"is gone: its process (pid {now['pid']} on {now['host']}) no longer "
                    f"exists{after}{was}")  # fmt: skip
            return {"kind": "gone", "running": running, "time": beat, "text": text}
        text = (f"does not answer: no heartbeat for {age:.0f} s (stopped, or stuck in native "
                f"code that holds the GIL){after}{was}")  # fmt: skip
        return {"kind": "silent", "running": running, "time": beat, "text": text}
    return {"kind": "running", "running": running, "where": where, "time": beat,
            "function": main.get("function") if main else None, "last": last}  # fmt: skip


# -- hang ---------------------------------------------------------------------------------------


def _members(ranks: dict[int, Rank], group: str, world: int) -> list[int]:
    for r in ranks.values():
        if group in r.now.get("groups", {}):
            return [int(x) for x in r.now["groups"][group]]
    return list(range(world))


def _hang(
    ranks: dict[int, Rank], state: dict[int, dict[str, Any]], ref: float, hang_after: float
) -> list[Finding]:
    """A collective some members wait in, seen by their own heartbeats to last ``hang_after``.

    Heartbeats are up to an interval old and not taken at one instant: a wait counts only as
    long as the waiting rank's own heartbeat saw it, and a member outside it only when its
    heartbeat is newer than the op's start (else it may have entered since).
    """
    waits: dict[tuple[str, int], list[tuple[int, list[Any]]]] = defaultdict(list)
    for r, s in state.items():
        for op in s["running"]:
            if op[flight.PEER] is None:
                waits[(op[flight.GROUP], op[flight.SEQ])].append((r, op))
    for (group, seq), waiting in sorted(waits.items(), key=lambda kv: -len(kv[1])):
        # (a waiting rank that went silent says nothing about how long the wait lasts)
        live = [(r, op) for r, op in waiting if state[r]["kind"] == "running"] or waiting
        seen = [state[r].get("time", ref) - float(op[flight.START]) for r, op in live]
        if min(seen) < hang_after:
            continue
        begun = max(float(op[flight.START]) for _, op in waiting)
        inside = {r for r, _ in waiting}
        members = _members(ranks, group, len(state))
        out = [r for r in members if r not in inside]
        if not out or any(
            (state[r]["kind"] == "running" and state[r]["time"] <= begun)
            or _passed(ranks.get(r), group, seq)
            or _finishing(state[r], group, seq, hang_after)
            for r in out
        ):
            # Everyone is in it (a slow op), a member was not yet seen outside it, it is over,
            # or a member still leaves the op before it (which the waiting ranks have left).
            continue
        names = Counter(op[flight.OP] for _, op in waiting)
        op_name, _ = names.most_common(1)[0]
        first = next(op for _, op in waiting if op[flight.OP] == op_name)
        parts = [_why_not_in(r, state[r], group, first) for r in out]
        waiters = sorted(inside)
        parts.append(
            f"{_ranks(waiters)} wait{'s' if len(waiters) == 1 else ''} in {_label(first)}"
            f"{_at(first)} for {ref - min(float(op[flight.START]) for _, op in waiting):.1f} s"
        )
        return [Finding("hang", tuple(out), "; ".join(parts))]
    return []


def _finishing(s: dict[str, Any], group: str, seq: int, hang_after: float) -> bool:
    """Whether a live member is still leaving an earlier collective of ``group``.

    The waiting ranks got past that op, so it ends on this member too, a moment later; one
    that stays in it longer than ``hang_after`` is behind, and said so.
    """
    return s["kind"] == "running" and any(
        op[flight.GROUP] == group
        and op[flight.PEER] is None
        and op[flight.SEQ] < seq
        and s["time"] - float(op[flight.START]) < hang_after
        for op in s["running"]
    )


def _passed(rank: Rank | None, group: str, seq: int) -> bool:
    """Whether ``rank`` finished collective ``seq`` of ``group`` or a later one.

    Then the op is over: a rank's heartbeat that shows it waiting predates the op's end.
    """
    return rank is not None and any(
        o[flight.GROUP] == group and o[flight.PEER] is None and o[flight.SEQ] >= seq
        for o in reversed(rank.ops)
    )


def _why_not_in(r: int, s: dict[str, Any], group: str, op: list[Any]) -> str:
    label = _label(op)
    if s["kind"] != "running":
        return f"rank {r} never entered {label}: it {s['text']}"
    for mine in s["running"]:  # (a rank in this op under another name waits in it too)
        if mine[flight.GROUP] == group and mine[flight.PEER] is None:
            return f"rank {r} is behind: it waits in {_label(mine)}{_at(mine)}"
    if s["running"]:
        mine = s["running"][0]
        return f"rank {r} never entered {label}: it waits in {_label(mine)}{_at(mine)}"
    where = s.get("where")
    fn = f" (in {s['function']})" if s.get("function") else ""
    last = s.get("last")
    after = f"; its last op, {_label(last)}, finished" if last else ""
    at = f" it runs {where}{fn}," if where else ""
    return f"rank {r} never entered {label}:{at} outside any collective{after}"


def _ranks(rs: list[int]) -> str:
    return ("rank " if len(rs) == 1 else "ranks ") + ", ".join(map(str, sorted(rs)))


# -- mismatch -----------------------------------------------------------------------------------


def _call(op: list[Any]) -> tuple[Any, ...]:
    return op[flight.OP], op[flight.NUMEL], op[flight.DTYPE]


def _mismatch(ranks: dict[int, Rank]) -> list[Finding]:
    calls: dict[tuple[str, int], dict[int, list[Any]]] = defaultdict(dict)
    for r, rank in ranks.items():
        for op in rank.ops + [o for o in rank.now.get("running", []) if o[flight.END] is None]:
            if op[flight.PEER] is None:
                calls[(op[flight.GROUP], op[flight.SEQ])][r] = op
    found = []
    for key in sorted(calls, key=lambda k: min(float(o[flight.START]) for o in calls[k].values())):
        by = calls[key]
        shapes = Counter(_call(o) for o in by.values())
        if len(shapes) < 2:
            continue
        common, _ = shapes.most_common(1)[0]
        odd = sorted(r for r, o in by.items() if _call(o) != common)
        usual = next(o for o in by.values() if _call(o) == common)
        parts = []
        for r in odd:
            o = by[r]
            other_op = o[flight.OP] != common[0]
            size = f"{o[flight.NUMEL]} x {o[flight.DTYPE] or '-'}"
            what = o[flight.OP] if other_op else f"{o[flight.OP]} of {size}"
            want = common[0] if other_op else f"{common[1]} x {common[2] or '-'}"
            parts.append(f"rank {r} called {what} as #{key[1]}{_at(o)} where the others called "
                         f"{want}{_at(usual)}")  # fmt: skip
        group = "" if key[0] == "world" else f" in group {key[0]!r}"
        found.append(Finding("mismatch", tuple(odd), "; ".join(parts) + group))
    return found


# -- straggler ----------------------------------------------------------------------------------


def _outside(rank: Rank, steps: int) -> float | None:
    """Seconds this rank spent outside communication per step: the lower quartile of its steps.

    Its last ``steps`` steps. A busy host only ever adds time to a step (4 ranks on 2 cores:
    a rank that wakes from a sleep waits for a core in about half its steps, 2-5 ms each), so
    the quartile measures what the rank itself needs, and a straggler is one slow in three
    steps of four or more.
    Measured on such a host with three CPU hogs beside the job, a rank 15 % slower came out
    1.12-1.15x the others by the quartile, 1.06-1.14x by the median.
    """
    windows = _windows(rank.steps)[-steps:]
    if len(windows) < MIN_STEPS:
        return None
    # On a GPU an op's time is when it ran there (its host times say when it was queued).
    first, last = windows[0][0], windows[-1][1]
    spans = sorted(sp for o in rank.ops if first <= (sp := span(o))[0] and sp[1] <= last)
    if not spans:
        return None
    gaps = [(t1 - t0) - _covered(spans, t0, t1) for t0, t1 in windows]
    return statistics.quantiles(gaps, n=4, method="inclusive")[0]


def _windows(marks: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """Each step's ``(start, end)``: from the previous step's end to its own.

    Where GPU times were taken on some steps only (``SHARDLINE_TRACE_GPU=N``), only those
    steps: on the others an NCCL op's times are when the host queued it and waited for it,
    not when it ran.
    """
    pairs = list(itertools.pairwise(marks))
    if any(m.get("gpu") is False for m in marks):
        pairs = [(a, b) for a, b in pairs if b.get("gpu")]
    return [(float(a["t1"]), float(b["t1"])) for a, b in pairs]


def _covered(spans: list[tuple[float, float]], t0: float, t1: float) -> float:
    """Seconds of ``[t0, t1]`` that ``spans`` (sorted) cover; overlapping ones count once."""
    inside, reach = 0.0, t0
    for start, end in spans:
        if start >= t1:
            break
        s, e = max(start, reach), min(end, t1)
        if e > s:
            inside += e - s
            reach = e
    return inside


def _straggler(ranks: dict[int, Rank], steps: int, slower: float) -> list[Finding]:
    per = {r: v for r, rank in ranks.items() if (v := _outside(rank, steps)) is not None}
    if len(per) < 2:
        return []
    worst = max(per, key=lambda r: per[r])
    others = statistics.median(v for r, v in per.items() if r != worst)
    if per[worst] < (1 + slower) * others or per[worst] - others < MIN_EXCESS:
        return []
    n = min(steps, *(len(_windows(ranks[r].steps)) for r in per))
    sampled = any(m.get("gpu") is False for r in per for m in ranks[r].steps)
    which = f"the last {n} steps" + (" timed on the GPU" if sampled else "")
    text = (f"rank {worst} spends {per[worst] * 1e3:.1f} ms per step outside communication, "
            f"{per[worst] / max(others, 1e-9) - 1:.0%} more than the other ranks' median "
            f"({others * 1e3:.1f} ms), by the lower quartile of {which}; they wait for "
            "it in every collective")  # fmt: skip
    return [Finding("straggler", (worst,), text)]


# -- settings -----------------------------------------------------------------------------------


def _settings(ranks: dict[int, Rank]) -> list[Finding]:
    values: dict[str, dict[int, Any]] = defaultdict(dict)
    for r, rank in ranks.items():
        c = rank.config
        if not c:
            continue
        for k, v in c.get("versions", {}).items():
            values[f"{k} version"][r] = v
        for k, v in c.get("settings", {}).items():
            if k not in PER_RANK:
                values[k][r] = v
        for k, v in c.get("notes", {}).items():
            values[k][r] = v
        values["world_size"][r] = c.get("world_size")
        values["backend"][r] = c.get("backend")
    findings = []
    for key, by in sorted(values.items()):
        counts = Counter(repr(v) for v in by.values())
        if len(counts) < 2:
            continue
        common, _ = counts.most_common(1)[0]
        odd = sorted(r for r, v in by.items() if repr(v) != common)
        usual = sorted(r for r in by if r not in odd)
        text = "; ".join(f"rank {r} has {key}={by[r]!r}" for r in odd)
        text += f" where {_ranks(usual)} {'has' if len(usual) == 1 else 'have'} {common}"
        findings.append(Finding("settings", tuple(odd), text))
    return findings
