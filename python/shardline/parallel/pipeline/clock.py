"""The timeline of one pipeline step: when each action computed and when it waited.

On CPU the host's clock is the truth: our engine's receives block the calling thread. On a
GPU the host runs ahead of the device and a receive is a kernel on the compute stream, so
the host's clock says when work was queued, not when it ran. There the marks are CUDA
events on the current stream, read once the step is over: an action's time is the device's,
and a receive's span (waiting for the peer, then the transfer) is what the stage idled.

Reading CUDA events waits for the step's last one, so ``StepTimes.resolve`` runs only when
someone reads ``last_step``, not on every step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["StepTimes"]


@dataclass
class StepTimes:
    """The marks one step recorded; ``resolve()`` turns them into seconds."""

    cuda: bool
    origin: Any = None
    end: Any = None
    # (kind, start, end, first wait, past the last wait): an action and its waits' indices
    actions: list[tuple[str, Any, Any, int, int]] = field(default_factory=list)
    waits: list[tuple[Any, Any]] = field(default_factory=list)

    @classmethod
    def on(cls, device: torch.device) -> StepTimes:
        """Marks by CUDA events on a GPU, by the host's clock elsewhere; starts now."""
        times = cls(cuda=device.type == "cuda")
        times.origin = times.mark()
        return times

    def mark(self) -> Any:
        """A point in the step: a recorded CUDA event, or the host's clock."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            event.record()
            return event
        return time.perf_counter()

    def _seconds(self, a: Any, b: Any) -> float:
        return float(a.elapsed_time(b)) / 1e3 if self.cuda else float(b - a)

    def resolve(self) -> dict[str, Any]:
        """``seconds`` of the step, ``busy`` seconds computing, and the ``timeline``.

        The timeline lists (kind, start, end) in seconds from the step's start; an action's
        start is moved past its waits (they come before its compute).
        """
        if self.cuda:
            self.end.synchronize()
        busy, timeline = 0.0, []
        for kind, a, b, w0, w1 in self.actions:
            waited = sum(self._seconds(x, y) for x, y in self.waits[w0:w1])
            start, stop = self._seconds(self.origin, a) + waited, self._seconds(self.origin, b)
            busy += max(0.0, stop - start)
            timeline.append((kind, start, stop))
        return {"seconds": self._seconds(self.origin, self.end), "busy": busy,
                "timeline": timeline}  # fmt: skip
