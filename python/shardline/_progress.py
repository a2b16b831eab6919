"""Progress lines for long checkpoint saves and loads, shown on rank 0.

A line appears only once an operation has run for ``delay`` seconds (short saves stay quiet).
On a terminal it is redrawn in place; in a log file a line is written at every quarter and at
the end. ``SHARDLINE_PROGRESS=0`` turns them off everywhere, ``=1`` shows them at once.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable
from typing import TextIO

from shardline import config

__all__ = ["Progress", "wanted"]

DELAY_S = 2.0
_WIDTH = 24


def wanted(progress: bool | None, rank: int) -> tuple[bool, float]:
    """(show, delay): the caller's choice, else the environment, else rank 0 after a delay."""
    if progress is None:
        progress = config.get("SHARDLINE_PROGRESS")
    if progress is None:
        return rank == 0, DELAY_S
    return progress, 0.0


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


class Progress:
    """Bytes done of ``total`` for ``what``; thread-safe ``add``/``set``; ``close`` at the end.

    ``total`` of ``None`` shows bytes and rate without a bar (e.g. a compressed file whose
    final size is unknown). ``poll`` (called every ``interval`` seconds on a thread of its
    own) lets progress come from outside, such as the size of a file being written.
    """

    def __init__(
        self,
        what: str,
        total: int | None,
        *,
        enabled: bool = True,
        delay: float = DELAY_S,
        stream: TextIO | None = None,
        poll: Callable[[], int] | None = None,
        interval: float = 0.25,
    ) -> None:
        self.what = what
        self.total = total
        self.enabled = enabled
        self.delay = delay
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.done = 0
        self.shown = False
        self.next_quarter = 1
        self._start = time.monotonic()
        self._last_draw = 0.0
        self._drawn = 0  # length of the line on a terminal, to blank what a shorter one leaves
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if enabled and poll is not None:
            self._thread = threading.Thread(
                target=self._poll, args=(poll, interval), name="shardline-progress", daemon=True
            )
            self._thread.start()

    def _poll(self, poll: Callable[[], int], interval: float) -> None:
        while not self._stop.wait(interval):
            with contextlib.suppress(OSError):  # the file is not there yet, or renamed
                self.set(poll())

    def add(self, n: int) -> None:
        """Counts ``n`` more bytes done."""
        if self.enabled:
            with self._lock:
                self.done += n
                self._draw(final=False)

    def set(self, done: int) -> None:
        """Sets the bytes done so far."""
        if self.enabled:
            with self._lock:
                self.done = max(self.done, done)
                self._draw(final=False)

    def close(self, ok: bool = True) -> None:
        """Stops polling; a shown line is completed (at 100 % when ``ok``)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if not self.enabled:
            return
        with self._lock:
            if ok and self.total is not None:
                self.done = self.total
            if self.shown or time.monotonic() - self._start >= self.delay:
                self._draw(final=True, failed=not ok)

    def line(self, failed: bool = False) -> str:
        """The text of the progress line as it stands."""
        elapsed = max(time.monotonic() - self._start, 1e-9)
        rate = f"{self.done / elapsed / 1e9:.2f} GB/s"
        if self.total:
            frac = min(self.done / self.total, 1.0)
            bar = "#" * int(frac * _WIDTH) + "." * (_WIDTH - int(frac * _WIDTH))
            left = (self.total - self.done) / (self.done / elapsed) if self.done else 0.0
            eta = f", {left:.0f} s left" if 0 < frac < 1 else ""
            text = (
                f"{self.what} [{bar}] {frac:4.0%} {_gb(self.done)} of {_gb(self.total)}, "
                f"{rate}{eta}"
            )
        else:
            text = f"{self.what}: {_gb(self.done)}, {rate}"
        if failed:
            text += " -- failed"
        elif self.total is None or self.done >= self.total:
            text += f" in {elapsed:.1f} s"
        return text

    def _draw(self, final: bool, failed: bool = False) -> None:
        now = time.monotonic()
        if not final and now - self._start < self.delay:
            return
        frac = self.done / self.total if self.total else 0.0
        if self.tty:
            if final or now - self._last_draw >= 0.1:
                end = "\n" if final else ""
                text = self.line(failed)
                self.stream.write("\r" + text.ljust(self._drawn) + end)
                self._drawn = len(text)
                self.stream.flush()
                self._last_draw = now
                self.shown = True
            return
        # A log file: the first line once the delay has passed, then every quarter, then done
        # (once: a quarter line at 100 % is the last).
        if self.next_quarter > 4 and not (final and failed):
            return
        if final or not self.shown or frac * 4 >= self.next_quarter:
            self.stream.write(self.line(failed) + "\n")
            self.stream.flush()
            self.shown = True
            self.next_quarter = 5 if final or failed else int(frac * 4) + 1
