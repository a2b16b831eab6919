"""The program's line of an op: where the user's code called into shardline (or torch).

Every traced op carries it (``flight.FlightRecorder.start``, ``shardline.comm.trace``): the
first frame out from the op whose code is the program's, not shardline's (but for its example
programs), torch's or frozen. Two walks find it: by each frame's module name on Python 3.12
and later (without a frame object per frame), and by each frame's file.

An op of a backward that runs on torch's autograd thread of a GPU has no program frame on its
own thread: it is placed at the program's line of the backward in progress, the
``loss.backward()`` that the program's thread is blocked in (``_backward_line``).

A tracer takes its ops' lines through ``LINES`` (``StepLines``): walked on some steps, and on
the steps between, for an op that repeats the op at its place in the last walked step, that
op's line.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

__all__ = ["LINES", "StepLines", "callsite", "program_frame"]

_libraries: tuple[str, ...] = ()
_programs: tuple[str, ...] = ()  # shardline's own programs (the main job): the user's code


def _library_dirs() -> tuple[str, ...]:
    """The folders of shardline's and torch's files, as their code objects name them."""
    global _libraries, _programs
    if not _libraries:
        dirs, programs = {contextlib.__file__}, set()  # a span's own ``with`` frames
        for name in ("shardline", "torch"):
            module = sys.modules.get(name)
            path = getattr(module, "__file__", None)
            for folder in (
                {str(Path(path).parent), str(Path(path).resolve().parent)} if path else ()
            ):
                dirs.add(folder + os.sep)
                if name == "shardline":
                    programs.add(os.path.join(folder, "examples") + os.sep)
        _libraries, _programs = tuple(dirs), tuple(programs)
    return _libraries


# Whether a file is the program's (``program_frame``), by the name its code objects give it.
_PROGRAM_FILES: dict[str, bool] = {}
# ``(code, "file:line")`` by the code object's id and instruction (``_where``): a frame's line
# number is worked out from its code's line table, which costs microseconds in a long
# function. Keyed by id, not by the code object: on Python 3.12 a code object's hash walks
# all of its instructions, each time (on an H200 host 0.3 us for a model's ``forward``, 2 us
# for a module's code, on every traced op). The entry holds its code object, so the id stays
# that code's while the entry lives.
_WHERE: dict[tuple[int, int], tuple[Any, str]] = {}
# Whether a module is shardline's (but for its example programs), torch's or ``contextlib``,
# by name (``_callsite_by_module``).
_LIBRARY_MODULES: dict[str, bool] = {}
# Python 3.12's ``sys._getframemodulename``: the module of a frame deeper in the stack,
# read without making a frame object for it.
_FRAME_MODULE = getattr(sys, "_getframemodulename", None)


def program_frame(frame: Any) -> Any:
    """The first frame out from ``frame`` in the program's own code (see ``callsite``)."""
    known = _PROGRAM_FILES
    f = frame
    while f is not None:
        name = f.f_code.co_filename
        mine = known.get(name)
        if mine is None:
            mine = known[name] = _program_file(name)
        if mine:
            return f
        f = f.f_back
    return None


def _program_file(name: str) -> bool:
    """Whether code of file ``name`` is the program's.

    Not shardline's (but for its example programs), torch's, or frozen (``<...>``).
    """
    skip = _libraries or _library_dirs()
    return (not name.startswith(skip) or name.startswith(_programs)) and name[:1] != "<"


def callsite(frame: Any = None, skip: int = 0) -> str | None:
    """``"train.py:57"``: where the program called into shardline (or torch), from ``frame``.

    The first frame, walking out from ``frame`` (the caller's caller by default, or ``skip``
    frames further out), whose file is neither shardline's (but for its example programs)
    nor torch's (nor frozen: ``<...>``): the user's line that issued the op, even when the
    op runs inside ``loss.backward()`` or a strategy's hook. On a thread that runs library
    code only, such as torch's autograd thread of a GPU (which runs a strategy's backward
    hooks), the line of the backward in progress (``_backward_line``); ``None`` where there is
    none.

    On every traced op's path. An op from a strategy's hook is some 10-40 frames deep, and
    walking them makes a frame object of each: on Python 3.12 and later, frames of library
    modules are passed by their module's name, without one. Inside a GPU training step each
    frame passed costs half a microsecond to a microsecond (on an H200 host; five to ten
    times a loop's), so frames known to be shardline's are not looked at (``skip``).
    """
    if frame is None and _FRAME_MODULE is not None:
        return _callsite_by_module(3 + skip)  # this (0), callsite (1), its caller (2)
    f = program_frame(frame if frame is not None else sys._getframe(2 + skip))
    return _backward_line() if f is None else _where(f)


def _callsite_by_module(depth: int) -> str | None:
    """``callsite`` from the frame ``depth`` levels out from here, on Python 3.12+."""
    assert _FRAME_MODULE is not None
    module, known = _FRAME_MODULE, _LIBRARY_MODULES
    library = known.get
    while True:
        while library(module(depth)):  # a module met and found a library's
            depth += 1
        name = module(depth)  # None: past the outermost frame, or a frame of no module
        if name is None or name in known:
            break
        known[name] = _library_module(name)  # met for the first time: look at it again
    # The frame itself, or None past the outermost one (without raising, as _getframe would).
    frame = sys._getframe(depth - 1).f_back
    f = None if frame is None else program_frame(frame)  # by its file, as for any frame
    return _backward_line() if f is None else _where(f)


def _library_module(name: str) -> bool:
    """Whether module ``name``'s frames are passed over by ``callsite``.

    Shardline's (but for its example programs), torch's, and ``contextlib``'s (a span's own
    ``with`` frames).
    """
    top = name.partition(".")[0]
    if top == "shardline":
        return not name.startswith("shardline.examples")
    return top == "torch" or name == "contextlib"


def _where(f: Any) -> str:
    """``"file:line"`` of frame ``f``."""
    code = f.f_code
    key = (id(code), f.f_lasti)
    known = _WHERE.get(key)
    if known is not None:
        return known[1]
    if len(_WHERE) > 100_000:  # a program that makes code without end: start again
        _WHERE.clear()
    where = f"{code.co_filename}:{f.f_lineno}"
    _WHERE[key] = (code, where)
    return where


# -- an op of a backward on torch's autograd thread -------------------------------------------

# The autograd graph task (one ``backward()`` or ``autograd.grad()`` call; torch numbers them
# from a process-wide counter, so an id is never reused) whose line was last looked for, and
# that line: ``(task id, "file:line" or None)``, in a list of one (replaced whole).
_BACKWARD: list[tuple[int, str | None]] = [(-1, None)]


# The id of the autograd graph task this thread runs a part of; -1 outside one.
_graph_task: Callable[[], int] = getattr(torch._C, "_current_graph_task_id", lambda: -1)


def _backward_line() -> str | None:
    """The program's line of the backward this thread runs a part of; None outside one.

    On a GPU, torch runs a backward's work on a thread of its own per device, where every
    frame is a library's (torch's, calling a strategy's hook): the program's line is on the
    thread that called the backward and is blocked in it until it ends. It is looked for once
    per backward (graph task); the backward's other ops cost one call into torch (0.1 us in
    a loop).
    """
    task = _graph_task()
    if task < 0:
        return None
    last, where = _BACKWARD[0]
    if task != last:
        where = _backward_caller()
        _BACKWARD[0] = (task, where)
    return where


def _backward_caller() -> str | None:
    """The program's line of the ``backward()`` or ``autograd.grad()`` another thread is in.

    The program's main thread is looked at first; where two threads each run a backward at
    once, the one found first is taken (torch does not say which thread started a task).
    """
    engine = _engine_codes()
    me, main = threading.get_ident(), threading.main_thread().ident
    frames = sys._current_frames()
    for ident in sorted(frames, key=lambda t: t != main):
        f = frames[ident] if ident != me else None
        while f is not None and id(f.f_code) not in engine:
            f = f.f_back
        if f is not None and (p := program_frame(f)) is not None:
            return _where(p)
    return None


@functools.cache
def _engine_codes() -> frozenset[int]:
    """The ids of the code of torch's functions that call its autograd engine and wait.

    By id, as ``_WHERE``: these functions live as long as torch.
    """
    functions = (getattr(torch.autograd.graph, "_engine_run_backward", None),
                 torch.autograd.backward, torch.autograd.grad)  # fmt: skip
    codes = (getattr(f, "__code__", None) for f in functions)
    return frozenset(id(c) for c in codes if c is not None)


# -- the lines of a step's ops, walked on some steps and repeated between --------------------

# The most ops of a step whose lines are kept for the steps after it.
_STEP_OPS = 100_000


class StepLines:
    """The program's line of every traced op, walked on some steps and repeated on the others.

    Walking the stack costs an op some microseconds inside a GPU training step (a tenth of
    that in a loop; 29 ops a step of a ZeRO-3 GPT on an H200 host took 0.8 % of its time),
    and a training step issues the same ops from the same lines every step. On a step whose
    lines are walked (``fresh``) every op's line is walked and kept by the op's place in the
    step; on the steps after, an op whose group, kind, size, element type and peer are those
    of the op at its place in the last walked step takes that op's line, and any other op
    (a step that issues other ops, or the same in another order, from its first difference
    on) has its own walked. ``step`` is told where each step ends (the tracer's optimizer
    step hook) and whether the next is walked.

    The ops of one step are numbered in the order they start; ops that two threads issue at
    once may be numbered in either order, and then are each checked against the other's.
    """

    def __init__(self) -> None:
        self.fresh = True  # whether this step's lines are walked
        self.place = 0  # the place in this step of its next op (on a step not walked)
        # (group, op, numel, dtype, peer, line) of each op, by place: of the last step walked,
        # and of this one while it is walked.
        self._taken: list[tuple[Any, ...]] = []
        self._taking: list[tuple[Any, ...]] = []
        # What a step not walked repeats: ``_taken``; nothing on a step walked. The flight
        # recorder takes a line that repeats from here itself, and calls ``where`` for any
        # other (in a GPU step every call costs: a method's call took as long as the rest).
        self.repeat: list[tuple[Any, ...]] = []

    def where(
        self, group: str, op: str, numel: int, dtype: object, peer: int | None, skip: int
    ) -> str | None:
        """The line of an op starting now (``callsite(skip=skip)`` from the caller's view)."""
        if self.fresh:
            where = callsite(skip=skip + 1)
            taking = self._taking
            if len(taking) < _STEP_OPS:
                taking.append((group, op, numel, dtype, peer, where))
            return where
        place = self.place
        self.place = place + 1
        taken = self._taken
        if place < len(taken):
            t = taken[place]
            if t[2] == numel and t[1] == op and t[0] == group and t[3] == dtype and t[4] == peer:
                return t[5]  # type: ignore[no-any-return]
        return callsite(skip=skip + 1)

    def step(self, fresh: bool) -> None:
        """A step ended; whether the next one walks its ops' lines.

        A walked step that issued ops is the one the steps after it repeat.
        """
        if self.fresh and self._taking:
            self._taken = self._taking
        self._taking = []
        self.place = 0
        self.set_fresh(fresh)

    def set_fresh(self, fresh: bool) -> None:
        """Whether the step under way, before its first op, walks its ops' lines."""
        self.fresh = fresh
        self.repeat = [] if fresh else self._taken

    def reset(self) -> None:
        """Forgets the steps so far; the next step walks its lines."""
        self._taken, self._taking, self.place, self.fresh, self.repeat = [], [], 0, True, []


LINES = StepLines()
