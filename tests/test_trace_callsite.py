"""The program's line of a traced op (``program_line.callsite``): the user's code that issued it.

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

from shardline.comm import flight, program_line
from shardline.comm.flight import RECORDER
from shardline.comm.trace import folder
from shardline.comm.trace.recorder import Tracer
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
        monkeypatch.setattr(program_line, "_FRAME_MODULE", None)
    elif program_line._FRAME_MODULE is None:
        monkeypatch.setattr(program_line, "_FRAME_MODULE", _frame_module)
    monkeypatch.setattr(RECORDER, "sink", [])
    monkeypatch.setattr(RECORDER, "enabled", False)
    program_line.LINES.reset()  # every op's line walked, as on a tracer's first step
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
        seen.append((program_line.callsite(), program_line.callsite(sys._getframe(1))))

    hooked = torch.nn.Module()
    hooked.forward = issue  # type: ignore[method-assign]
    hooked()  # both walks' line
    where = f"{__file__}:{_line_of('hooked()  #')}"
    assert seen == [(where, where)]
    library = program_line._library_module
    assert library("torch.nn.modules.module") and library("shardline.parallel.zero")
    assert not library("shardline.examples.train")
    assert not library("torchvision.models") and not library("t")


def test_each_code_objects_line_is_its_own_though_the_first_is_gone() -> None:
    """Lines are kept by code object id (Python 3.12 hashes a code object by walking all its
    instructions, on every op): a code object freed after its line was worked out must not
    hand that line to a new one made at its address."""

    def line_of_a_new_function(n: int) -> str:
        source = "\n" * n + "def f(_where):\n    import sys\n    return _where(sys._getframe())\n"
        scope: dict[str, object] = {}
        exec(compile(source, f"<made {n}>", "exec"), scope)
        return scope["f"](program_line._where)  # type: ignore[operator]

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


def _in_a_library_thread(ops: int) -> list[Any]:
    """Records of ``ops`` ops issued from a thread whose every frame is a library's (as torch's
    autograd thread of a GPU, running a strategy's backward hook)."""
    source = "def issue(start):\n    return start('world', 0, 'all_reduce', 8, None, None)\n"
    scope: dict[str, Any] = {"__name__": "torch._a_hook"}
    exec(compile(source, os.path.join(os.path.dirname(torch.__file__), "_a_hook.py"), "exec"),
         scope)  # fmt: skip
    done = threading.Event()
    out: list[Any] = []
    # The thread's one function is the library's too, and nothing is below it: started by
    # ``_thread``, not ``threading`` (whose frames are the program's by this rule).
    run_code = compile(
        "def run():\n    try:\n        for _ in range(ops):\n"
        "            out.append(scope['issue'](RECORDER.start))\n"
        "    finally:\n        done.set()\n",
        os.path.join(os.path.dirname(torch.__file__), "_a_thread.py"), "exec",
    )  # fmt: skip
    thread_scope: dict[str, Any] = {"__name__": "torch._a_thread", "out": out, "done": done,
                                    "scope": scope, "RECORDER": RECORDER, "ops": ops}  # fmt: skip
    exec(run_code, thread_scope)
    _thread.start_new_thread(thread_scope["run"], ())
    assert done.wait(10)
    assert len(out) == ops
    # From this thread, the same function is placed at its caller's line.
    mine = scope["issue"](RECORDER.start)  # from this thread
    assert mine[flight.WHERE] == f"{__file__}:{_line_of('# from this thread')}"
    return out


def test_an_op_from_a_thread_of_library_code_only_has_no_line(walk: str) -> None:
    """Outside a backward, such a thread's op has no program line: the walk reaches the
    outermost frame and gives ``None``."""
    (record,) = _in_a_library_thread(1)
    assert record[flight.WHERE] is None


def test_an_op_of_a_backward_on_a_library_thread_is_placed_at_the_backwards_line(
    walk: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a GPU, torch runs a backward's hooks on a thread of its own: their ops are placed at
    the program's ``loss.backward()`` line, read from the thread blocked in it, once per
    backward (torch's graph task). Here the library thread is started from a hook of a real
    backward on this thread, and told that backward's task id (torch gives it only to its own
    threads)."""
    task = [-1]
    monkeypatch.setattr(program_line, "_graph_task", lambda: task[0])
    monkeypatch.setattr(program_line, "_BACKWARD", [(-1, None)])
    records: list[Any] = []

    def hook(grad: torch.Tensor) -> None:
        task[0] = torch._C._current_graph_task_id()
        records.extend(_in_a_library_thread(2))

    x = torch.ones(2, requires_grad=True)
    x.register_hook(hook)
    (x * 2).sum().backward()  # the backward's line
    where = f"{__file__}:{_line_of('# the backward')}"
    assert task[0] >= 0 and [r[flight.WHERE] for r in records] == [where, where]
    assert program_line._BACKWARD[0] == (task[0], where)
    # Once per backward: its line is kept for its task, and a new task is looked for afresh
    # (here none is in progress on any thread; torch's next would be this one's plus one).
    assert program_line._backward_line() == where
    task[0] += 1000
    assert program_line._backward_line() is None


def _op_a() -> list[Any]:
    return RECORDER.start("world", 0, "all_reduce", 8, torch.float32, None)  # line of a


def _op_b() -> list[Any]:
    return RECORDER.start("world", 1, "all_gather", 16, torch.float32, None)  # line of b


def _op_b_to(peer: int) -> list[Any]:
    return RECORDER.start("world", 1, "all_gather", 16, torch.float32, peer)  # b to a peer


@pytest.fixture
def walked(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A 1 for every line walked (``program_line.callsite`` called), from now on."""
    calls: list[int] = []
    real = program_line.callsite

    def counted(frame: Any = None, skip: int = 0) -> str | None:
        calls.append(1)
        return real(frame, skip + 1)

    monkeypatch.setattr(program_line, "callsite", counted)
    return calls


def test_a_step_repeats_the_walked_steps_lines_where_its_ops_repeat_its_ops(
    walk: str, walked: list[int]
) -> None:
    """On a step whose lines are not walked, an op with the group, kind, size, element type
    and peer of the op at its place in the last walked step takes that op's line; any other
    op, and every op after a step's first difference, has its own line walked."""
    lines = program_line.LINES
    a, b = (f"{__file__}:{_line_of(f'# line of {x}')}" for x in "ab")
    b_to = f"{__file__}:{_line_of('# b to a peer')}"

    def step(*ops: Any, fresh: bool = False) -> tuple[list[str | None], int]:
        walked.clear()
        got = [op()[flight.WHERE] for op in ops]
        lines.step(fresh)
        return got, len(walked)

    assert step(_op_a, _op_b) == ([a, b], 2)  # the first step: walked
    assert step(_op_a, _op_b) == ([a, b], 0)  # repeated
    assert step(_op_b, _op_a) == ([b, a], 2)  # another order: walked
    assert step(_op_a, _op_b, _op_a) == ([a, b, a], 1)  # one op more: it is walked
    assert step(_op_a, lambda: _op_b_to(3)) == ([a, b_to], 1)  # another peer
    assert step(_op_a, _op_b, fresh=True) == ([a, b], 0)  # the next step is walked
    assert step(_op_b, _op_b) == ([b, b], 2)  # walked, and now the one repeated
    assert step(_op_b, _op_a, fresh=True) == ([b, a], 1)  # a walked step without ops ...
    assert step() == ([], 0)
    assert step(_op_b, _op_b) == ([b, b], 0)  # ... leaves the last one with ops repeated


def test_a_tracer_walks_the_lines_on_its_sampled_steps_and_repeats_them_between(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, walked: list[int]
) -> None:
    """With ``SHARDLINE_TRACE_GPU=2`` the tracer walks its ops' lines on steps 0, 2 and 4 (its
    optimizer step hook says where each step ends); on steps 1 and 3 the loop's op takes the
    line walked before, and step 3's op of its own is walked. Every op is written with its
    own line."""
    monkeypatch.setenv("SHARDLINE_TRACE_GPU", "2")
    tracer = Tracer()
    tracer.start(tmp_path, rank=0, world_size=1, backend="native", interval=60.0)
    opt = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
    per_step = []
    try:
        for step in range(5):
            walked.clear()
            RECORDER.finish(RECORDER.start("world", step, "all_reduce", 8, None, None))  # loop
            if step == 3:
                RECORDER.finish(RECORDER.start("world", 9, "broadcast", 4, None, None))  # own
            opt.step()
            per_step.append(len(walked))
    finally:
        tracer.stop()
    assert per_step == [1, 0, 1, 1, 1]
    ops = folder.load(tmp_path)[0].ops
    loop, own = (f"{__file__}:{_line_of(f'None, None))  # {x}')}" for x in ("loop", "own"))
    assert [(o[flight.OP], o[flight.WHERE]) for o in ops] == [
        *[("all_reduce", loop)] * 4,
        ("broadcast", own),
        ("all_reduce", loop),
    ]
