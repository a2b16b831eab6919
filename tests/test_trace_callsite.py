"""The program's line of a traced op (``flight.callsite``): the user's code that issued it.

Two walks find it: by each frame's module name (Python 3.12+, ``sys._getframemodulename``,
without a frame object per frame) and by each frame's file. Every test runs both; on an older
Python the module walk runs on a stand-in for ``sys._getframemodulename``.
"""

from __future__ import annotations

import _thread
import functools
import os
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from shardline.comm import flight
from shardline.comm.flight import RECORDER
from tests._ranks import run_ranks


def _frame_module(depth: int) -> str | None:
    """``sys._getframemodulename`` in Python: its caller's frame is depth 0."""
    try:
        frame = sys._getframe(depth + 1)
    except ValueError:  # past the outermost frame
        return None
    return frame.f_globals.get("__name__")


@pytest.fixture(params=["modules", "files"])
def walk(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each walk, and a sink listening (so ``RECORDER.start`` looks for the line)."""
    if request.param == "files":
        monkeypatch.setattr(flight, "_FRAME_MODULE", None)
    elif flight._FRAME_MODULE is None:
        monkeypatch.setattr(flight, "_FRAME_MODULE", _frame_module)
    monkeypatch.setattr(RECORDER, "sink", [])
    monkeypatch.setattr(RECORDER, "enabled", False)
    return str(request.param)


def _line_of(text: str) -> int:
    lines = Path(__file__).read_text().splitlines()
    return next(i for i, x in enumerate(lines, 1) if text in x and "_line_of" not in x)


def test_an_op_issued_inside_torch_and_shardline_is_placed_at_the_programs_line(
    walk: str,
) -> None:
    """As a strategy's hook issues its ops from inside torch's module call: the line is the
    program's that made the call, the same whether the walk passes library frames by their
    module's name (Python 3.12+) or by their files."""
    module = torch.nn.Module()
    module.forward = functools.partial(  # type: ignore[method-assign]
        RECORDER.start, "world", 0, "all_reduce", 8, None, None
    )
    record = module()  # the op's line
    assert record[flight.WHERE] == f"{__file__}:{_line_of('record = module()  #')}"
    seen: list[tuple[str | None, str | None]] = []

    def issue() -> None:  # called by torch's frames, as a hook is
        seen.append((flight.callsite(), flight.callsite(sys._getframe(1))))

    hooked = torch.nn.Module()
    hooked.forward = issue  # type: ignore[method-assign]
    hooked()  # both walks' line
    where = f"{__file__}:{_line_of('hooked()  #')}"
    assert seen == [(where, where)]
    assert flight._library_module("torch.nn.modules.module")
    assert flight._library_module("shardline.parallel.zero")
    assert not flight._library_module("shardline.examples.train")
    assert not flight._library_module("torchvision.models") and not flight._library_module("t")


def test_each_code_objects_line_is_its_own_though_the_first_is_gone() -> None:
    """Lines are kept by code object id (Python 3.12 hashes a code object by walking all its
    instructions, on every op): a code object freed after its line was worked out must not
    hand that line to a new one made at its address."""

    def line_of_a_new_function(n: int) -> str:
        source = "\n" * n + "def f(_where):\n    import sys\n    return _where(sys._getframe())\n"
        scope: dict[str, object] = {}
        exec(compile(source, f"<made {n}>", "exec"), scope)
        return scope["f"](flight._where)  # type: ignore[operator]

    assert line_of_a_new_function(0) == "<made 0>:3"  # its function and code object are freed
    for n in range(1, 200):  # new code objects, many at a freed one's address
        assert line_of_a_new_function(n) == f"<made {n}>:{n + 3}"


def test_a_groups_op_is_placed_at_the_line_that_called_it(walk: str) -> None:
    """The walk starts past the group's own frames (``_record``, ``_submit``, the op): one
    frame too many skipped would name the caller of the line below."""

    def body(group: Any) -> list[Any]:
        group.all_reduce(torch.ones(4))  # the group's op, first
        group.broadcast(torch.ones(2), src=0)  # the group's op, second
        return list(RECORDER.sink or [])

    (records,) = run_ranks(1, body, backend="gloo")
    got = [(r[flight.OP], r[flight.WHERE]) for r in records]
    first, second = _line_of("op, first"), _line_of("op, second")
    assert got == [("all_reduce", f"{__file__}:{first}"), ("broadcast", f"{__file__}:{second}")]


def test_an_op_from_a_thread_of_library_code_only_has_no_line(walk: str) -> None:
    """A thread whose every frame is a library's (torch's autograd thread of a GPU, running a
    strategy's backward hook): the walk reaches the outermost frame and gives ``None``."""
    source = "def issue(start):\n    return start('world', 0, 'all_reduce', 8, None, None)\n"
    scope: dict[str, Any] = {"__name__": "torch._a_hook"}
    exec(compile(source, os.path.join(os.path.dirname(torch.__file__), "_a_hook.py"), "exec"),
         scope)  # fmt: skip
    done = threading.Event()
    out: list[Any] = []
    # The thread's one function is the library's too, and nothing is below it: started by
    # ``_thread``, not ``threading`` (whose frames are the program's by this rule).
    run_code = compile(
        "def run():\n    try:\n        out.append(scope['issue'](RECORDER.start))\n"
        "    finally:\n        done.set()\n",
        os.path.join(os.path.dirname(torch.__file__), "_a_thread.py"), "exec",
    )  # fmt: skip
    thread_scope: dict[str, Any] = {"__name__": "torch._a_thread", "out": out, "done": done,
                                    "scope": scope, "RECORDER": RECORDER}  # fmt: skip
    exec(run_code, thread_scope)
    _thread.start_new_thread(thread_scope["run"], ())
    assert done.wait(10)
    (record,) = out
    assert record[flight.WHERE] is None
    # From this thread, the same function is placed at this test's line.
    record = scope["issue"](RECORDER.start)  # this line
    assert record[flight.WHERE] == f"{__file__}:{_line_of('# this line')}"
