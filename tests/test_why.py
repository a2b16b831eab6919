"""The flight recorder and ``shardline why``: records per op, dumps, and the one sentence.

The sentence is checked on hand-made answers and dumps (its oracle is the situation written
down); the records on a real two-rank group (ranks as threads). The end-to-end case (a rank
stopped with SIGSTOP, every other rank's error naming it) is in
``tests/multiprocess/test_stuck.py``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from shardline.comm import flight
from shardline.comm.flight import RECORDER, FlightRecorder
from shardline.comm.why import Where, explain, explain_dumps, load_dumps
from tests._ranks import run_ranks

NOW = 1_000_000.0


def _why_cli(folder: Path) -> str:
    """What ``shardline why FOLDER --ops 2`` prints (it must exit 0)."""
    cli = subprocess.run(
        [sys.executable, "-m", "shardline", "why", str(folder), "--ops", "2"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert cli.returncode == 0, cli.stderr
    return cli.stdout


def test_a_silent_rank_is_named_with_the_op_the_others_wait_in() -> None:
    waiting = Where("all_reduce", 1533, NOW - 31, "running")
    got = explain({0: waiting, 1: waiting, 2: None, 3: waiting}, NOW)
    assert got == (
        "rank 2 never entered all_reduce #1533 (no answer from it: stopped, or busy outside "
        "shardline); ranks 0, 1, 3 wait in it since 31 s"
    )


def test_a_rank_in_another_op_or_behind_is_told_apart() -> None:
    main = Where("all_reduce", 10, NOW - 5, "running")
    got = explain(
        {
            0: main,
            1: main,
            2: Where("broadcast", 10, NOW - 4, "running"),
            3: Where("all_reduce", 9, NOW - 20, "done"),
        },
        NOW,
        group="world.1",
    )
    assert "rank 2 waits in broadcast #10 instead (the ranks call different ops)" in got
    assert "rank 3 never entered all_reduce #10: its last, all_reduce #9, finished 20 s ago" in got
    assert got.endswith("ranks 0, 1 wait in it of group 'world.1' since 5 s")


def test_nothing_to_say_when_nobody_waits() -> None:
    assert explain({0: Where("barrier", 3, NOW, "done"), 1: None}, NOW) == ""


def _dump(rank: int, ops: list[list[object]], world: int = 4) -> dict[str, object]:
    return {"rank": rank, "world_size": world, "pid": 1, "host": "h", "time": NOW,
            "reason": "test", "groups": {"world": list(range(world))}, "ops": ops}  # fmt: skip


def test_dumps_explain_the_newest_unfinished_collective(tmp_path: Path) -> None:
    def op(seq: int, state: str, start: float, peer: int | None = None) -> list[object]:
        end = None if state == "running" else start + 0.001
        return ["world", seq, "all_reduce", 4096, "float32", peer, start, end, state]

    done = [op(s, "done", NOW - 40 + s) for s in range(5)]
    stuck = [*done, op(5, "CollectiveTimeoutError", NOW - 31)]
    for rank, ops in {0: stuck, 1: stuck, 3: stuck}.items():
        (tmp_path / f"rank{rank}.json").write_text(json.dumps(_dump(rank, ops)))
    got = explain_dumps(load_dumps(tmp_path))
    assert got.startswith("rank 2 never entered all_reduce #5")
    assert got.endswith("ranks 0, 1, 3 wait in it since 31 s")
    # The command line reads the same folder.
    out = _why_cli(tmp_path)
    assert got in out and "all_reduce #5: 4096 x float32" in out, out


def test_running_point_to_point_ops_are_named_not_called_finished(tmp_path: Path) -> None:
    # Every collective finished, but rank 1 waits in a receive from rank 0, which waits in a
    # send to rank 1: the sentence names both, as the op listing does.
    coll = ["world", 0, "all_reduce", 16, "float32", None, NOW - 40, NOW - 39.9, "done"]
    send = ["world", 3, "send", 16, "float32", 1, NOW - 31, None, "running"]
    recv = ["world", 3, "recv", 16, "float32", 0, NOW - 30, None, "running"]
    for rank, ops in {0: [coll, send], 1: [coll, recv]}.items():
        (tmp_path / f"rank{rank}.json").write_text(json.dumps(_dump(rank, ops, world=2)))
    got = explain_dumps(load_dumps(tmp_path))
    assert "every recorded" not in got, got
    assert got == (
        "no collective holds the job up, but 2 ops were unfinished when the dumps were "
        "written: rank 0 waits in send #3 to rank 1 since 31 s; rank 1 waits in recv #3 from "
        "rank 0 since 30 s"
    )
    out = _why_cli(tmp_path)
    assert got in out and "send #3 peer 1: 16 x float32" in out, out


def test_a_finished_job_says_so(tmp_path: Path) -> None:
    done = ["world", 0, "barrier", 0, "", None, NOW - 5, NOW - 4.9, "done"]
    (tmp_path / "rank0.json").write_text(json.dumps(_dump(0, [done], world=1)))
    got = explain_dumps(load_dumps(tmp_path))
    assert got == "every recorded op finished: nothing was waiting when the dumps were written"


def test_a_missing_folder_is_an_error(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-job"
    cli = subprocess.run(
        [sys.executable, "-m", "shardline", "why", str(missing)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert cli.returncode == 1, (cli.stdout, cli.stderr)
    assert cli.stdout == "", cli.stdout
    assert f"shardline why: error: {missing} does not exist" in cli.stderr, cli.stderr
    assert "SHARDLINE_FLIGHT_DIR" in cli.stderr, cli.stderr


def test_a_corrupt_dump_is_an_error_naming_the_file(tmp_path: Path) -> None:
    (tmp_path / "rank0.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"rank0\.json is not a flight-recorder dump"):
        load_dumps(tmp_path)
    (tmp_path / "rank0.json").write_text('{"rank": 0}')  # JSON, not a dump: no traceback
    with pytest.raises(ValueError, match=r"rank0\.json is not a flight-recorder dump \(it lacks"):
        load_dumps(tmp_path)


def test_a_tracers_files_beside_the_dumps_are_not_read_as_dumps(tmp_path: Path) -> None:
    """``SHARDLINE_TRACE`` and ``SHARDLINE_FLIGHT_DIR`` may name one folder: its
    ``rank<r>.config.json`` and ``rank<r>.now.json`` are not dumps (``why`` raised KeyError)."""
    (tmp_path / "rank0.config.json").write_text('{"rank": 0, "settings": {}}')
    (tmp_path / "rank0.now.json").write_text('{"rank": 0, "state": "running"}')
    assert load_dumps(tmp_path) == []


def test_every_op_is_recorded_numbered_per_group_and_per_peer() -> None:
    start = time.time()

    def body(g: object) -> None:
        from shardline.comm import ProcessGroup

        assert isinstance(g, ProcessGroup)
        for _ in range(3):
            g.all_reduce(torch.ones(8))
        g.all_reduce(torch.ones(2), async_op=True).wait()
        if g.rank == 0:
            g.send(torch.ones(3), 1)
            g.send(torch.ones(3), 1)
        else:
            g.recv(torch.empty(3), 0)
            g.recv(torch.empty(3), 0)

    run_ranks(2, body, timeout=60)
    mine = [r for r in RECORDER.records() if r[flight.START] >= start]
    reduces = sorted(r[flight.SEQ] for r in mine if r[flight.OP] == "all_reduce")
    assert reduces == [0, 0, 1, 1, 2, 2, 3, 3]  # two ranks, numbered alike
    sends = [r for r in mine if r[flight.OP] == "send"]
    assert [(r[flight.SEQ], r[flight.PEER], r[flight.NUMEL]) for r in sends] == [
        (0, 1, 3),
        (1, 1, 3),
    ]
    assert all(r[flight.STATE] == "done" and r[flight.END] >= r[flight.START] for r in mine)
    assert {r[flight.DTYPE] for r in mine} == {"float32"}


def test_sigusr1_writes_the_dump(tmp_path: Path) -> None:
    old = signal.getsignal(signal.SIGUSR1)
    signal.signal(signal.SIGUSR1, signal.SIG_DFL)
    try:
        rec = FlightRecorder(capacity=2)
        rec.configure(rank=3, world_size=4, capacity=2, directory=tmp_path)
        assert rec.install_signal_handler()
        for seq in range(3):  # the oldest falls out
            rec.finish(rec.start("world", seq, "all_reduce", 4, "float32", None))
        os.kill(os.getpid(), signal.SIGUSR1)
        deadline = time.monotonic() + 10
        while not (tmp_path / "rank3.json").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        dump = json.loads((tmp_path / "rank3.json").read_text())
    finally:
        signal.signal(signal.SIGUSR1, old)
    assert dump["reason"] == "SIGUSR1" and dump["rank"] == 3 and dump["world_size"] == 4
    assert [op[flight.SEQ] for op in dump["ops"]] == [1, 2]


def test_a_recorder_turned_off_records_nothing(tmp_path: Path) -> None:
    rec = FlightRecorder()
    rec.configure(rank=0, world_size=1, capacity=0, directory=tmp_path)
    assert rec.start("world", 0, "barrier", 0, "", None) is None
    assert rec.dump("test") is None and not list(tmp_path.iterdir())
