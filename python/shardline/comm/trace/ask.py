"""The doctor's request for GPU times on every step, and how a traced rank answers it.

A rank traced on GPUs takes its NCCL ops' GPU times on one optimizer step in
``SHARDLINE_TRACE_GPU`` (16): timing an op there costs its host tens of microseconds, too
much for every step of a job that is left traced. The doctor's straggler check reads only
the timed steps, and 20 of them would take 320 steps to come by. So the doctor, checking a
live job, asks for them:

- it writes ``DIR/doctor.request.json``: an id and a number of steps (``ask``);
- each rank's tracer looks for it once per interval (one ``stat``: ``Inbox``), takes GPU
  times on every one of its next that many steps, from the next step on, and says so in its
  heartbeat: ``"asked": {"id", "from", "until"}``, beside ``"steps_written"``, how many
  steps its timeline holds;
- the doctor waits until every running rank that takes GPU times has written those steps
  and one more (a step's ops are written once the GPU is past them, by the same write or
  the next), then reads the folder again (``wait``).

A rank with GPU times turned off (``SHARDLINE_TRACE_GPU=0``) leaves the request unanswered,
and the doctor does not wait for it. A request older than a rank's tracer is not answered.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path
from typing import Any

from shardline.comm.trace.folder import read_object

__all__ = ["REQUEST", "Inbox", "ask", "wait"]

REQUEST = "doctor.request.json"
"""The request's file name, in the job's trace folder."""

# Steps a request may ask for: more would keep a job paying the timing for minutes.
MAX_STEPS = 1000
# How often ``wait`` reads the heartbeats.
_POLL_S = 0.1


def ask(directory: str | Path, steps: int) -> str:
    """Asks every rank tracing into ``directory`` for GPU times on its next ``steps`` steps.

    Returns the request's id (what each answering rank's heartbeat repeats).
    """
    request = {"id": uuid.uuid4().hex, "steps": int(steps), "time": time.time()}
    path = Path(directory) / REQUEST
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(request))
    tmp.replace(path)
    return str(request["id"])


class Inbox:
    """A rank's view of the request file: ``poll`` gives each new request once."""

    def __init__(self, directory: Path) -> None:
        """Watches ``directory``; a request already there is older than this rank: ignored."""
        self._path = directory / REQUEST
        self._seen = self._signature()
        self._last: str | None = None

    def _signature(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self._path)
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size, st.st_ino

    def poll(self) -> tuple[str, int] | None:
        """A request made since the last poll, as ``(id, steps)``; else ``None``.

        One ``stat`` when nothing changed. A file that cannot be read or holds no request
        (half written by a doctor of another host, say) is read again at the next change.
        """
        seen = self._signature()
        if seen is None or seen == self._seen:
            return None
        self._seen = seen
        try:
            request = read_object(self._path)
            rid, steps = str(request["id"]), int(request["steps"])
        except (OSError, ValueError, KeyError, TypeError):  # TypeError: "steps" not a number
            return None
        if rid == self._last or steps < 1:
            return None
        self._last = rid
        return rid, min(steps, MAX_STEPS)


def _answered(beat: dict[str, Any], rid: str) -> bool:
    asked = beat.get("asked") or {}
    if asked.get("id") != rid:
        return False
    return int(beat.get("steps_written", 0)) > int(asked.get("until", 0))


def wait(
    directory: str | Path, rid: str, ranks: list[int], timeout: float
) -> tuple[list[int], list[int]]:
    """Waits up to ``timeout`` seconds for ``ranks`` to answer request ``rid``.

    A rank answers once its heartbeat says it wrote the asked steps and one more. A rank
    whose heartbeat says its GPU times are off (``gpu_every`` 0), or that stopped beating
    ``running``, is not waited for.

    Returns:
        The ranks that answered, and those that did not (in time, or at all).
    """
    path = Path(directory)
    deadline = time.monotonic() + timeout
    answered: list[int] = []
    left = list(ranks)
    while True:
        still = []
        for r in left:
            try:
                beat = read_object(path / f"rank{r}.now.json")
            except (OSError, ValueError):
                still.append(r)  # being rewritten, or gone: asked again
                continue
            if beat.get("state") != "running" or not beat.get("gpu_every", 1):
                continue
            if _answered(beat, rid):
                answered.append(r)
            else:
                still.append(r)
        left = still
        if not left or time.monotonic() >= deadline:
            return sorted(answered), sorted(left)
        time.sleep(_POLL_S)
