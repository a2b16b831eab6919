"""The tracer's files and the doctor's reading of them, in one process (no job).

The fault-injection trials on real jobs are in ``tests/multiprocess/test_doctor.py``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from shardline.comm import flight
from shardline.comm.flight import RECORDER
from shardline.comm.trace import doctor, merge
from shardline.comm.trace.recorder import Tracer
from shardline.errors import InvalidArgumentError


@pytest.fixture
def tracer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Tracer]:
    monkeypatch.setenv("SHARDLINE_SECRET", "do-not-write-me")
    t = Tracer()
    t.start(tmp_path, rank=0, world_size=1, backend="native", interval=60.0)
    yield t
    t.stop()


def test_ops_steps_and_spans_land_in_the_timeline_with_the_users_line(
    tracer: Tracer, tmp_path: Path
) -> None:
    line = _line_of("RECORDER.start(")
    record = RECORDER.start("world", 0, "all_reduce", 8, torch.float32, None)
    RECORDER.finish(record)
    with tracer.span("forward"):
        pass
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    running = RECORDER.start("world", 1, "broadcast", 4, torch.int64, None)
    tracer.flush()
    events = [json.loads(x) for x in (tmp_path / "rank0.trace.jsonl").read_text().splitlines()]
    (op,) = [e["r"] for e in events if e["k"] == "op"]
    assert op[flight.OP] == "all_reduce" and op[flight.DTYPE] == "float32"
    assert op[flight.WHERE] == f"{__file__}:{line}"
    assert [e["name"] for e in events if e["k"] == "span"] == ["forward"]
    assert [e["n"] for e in events if e["k"] == "step"] == [0]
    now = json.loads((tmp_path / "rank0.now.json").read_text())
    assert now["state"] == "running" and now["steps"] == 1
    assert [(o[flight.OP], o[flight.SEQ]) for o in now["running"]] == [("broadcast", 1)]
    main = next(t for t in now["threads"] if t["main"])
    assert main["where"] == f"{__file__}:{_line_of('tracer.flush()')}"
    assert main["function"] == "test_ops_steps_and_spans_land_in_the_timeline_with_the_users_line"
    RECORDER.finish(running)
    tracer.stop()
    assert json.loads((tmp_path / "rank0.now.json").read_text())["state"] == "shutdown"
    config = json.loads((tmp_path / "rank0.config.json").read_text())
    assert config["settings"]["SHARDLINE_SECRET"] == "<set>"
    assert "do-not-write-me" not in "".join(p.read_text() for p in tmp_path.iterdir())
    doc = merge.chrome_trace(tmp_path)
    names = sorted(e["name"] for e in doc["traceEvents"] if e["ph"] == "X")
    assert names == ["all_reduce #0", "broadcast #1", "forward", "step 0"]


def _line_of(text: str) -> int:
    lines = Path(__file__).read_text().splitlines()
    return next(i for i, x in enumerate(lines, 1) if text in x and "_line_of" not in x)


def _rank(folder: Path, r: int, settings: dict[str, object], steps: list[float],
          gaps: float) -> None:  # fmt: skip
    """A finished rank's files: ``steps`` end times, one all-reduce before each, ``gaps``
    seconds outside communication per step."""
    (folder / f"rank{r}.config.json").write_text(json.dumps(
        {"rank": r, "world_size": 3, "backend": "native", "versions": {"torch": "2"},
         "settings": settings, "notes": {}}
    ))  # fmt: skip
    lines = []
    for n, t1 in enumerate(steps):
        start = t1 - 0.1 + gaps
        lines.append({"k": "op", "r": ["world", n, "all_reduce", 4, "float32", None, start,
                                       t1 - 0.001, "done", "train.py:9"]})  # fmt: skip
        lines.append({"k": "step", "n": n, "t0": t1 - 0.001, "t1": t1})
    (folder / f"rank{r}.trace.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    (folder / f"rank{r}.now.json").write_text(json.dumps(
        {"rank": r, "pid": os.getpid(), "host": "elsewhere", "time": steps[-1], "interval": 1,
         "state": "shutdown", "running": [], "threads": []}
    ))  # fmt: skip


def test_a_straggler_and_a_differing_setting_are_named(tmp_path: Path) -> None:
    steps = [100.0 + 0.1 * k for k in range(25)]
    for r in range(3):
        _rank(
            tmp_path,
            r,
            {"SHARDLINE_SPIN_US": 50 if r != 1 else 0},
            steps,
            0.02 if r != 2 else 0.025,
        )
    rep = doctor.examine(tmp_path)
    assert not rep.live and rep.steps == 25
    assert rep.culprits("straggler") == {2} and rep.culprits("settings") == {1}, rep.text()
    assert "rank 1 has SHARDLINE_SPIN_US=0 where ranks 0, 2 have 50" in rep.text()


def test_ranks_that_agree_give_no_finding(tmp_path: Path) -> None:
    steps = [100.0 + 0.1 * k for k in range(25)]
    for r in range(3):
        _rank(tmp_path, r, {"SHARDLINE_SPIN_US": 50}, steps, 0.02 + 0.0005 * r)  # < 7 % apart
    rep = doctor.examine(tmp_path)
    assert rep.findings == [], rep.text()
    assert rep.text().endswith("no hang, no straggler, no mismatch; settings agree")


def test_a_folder_without_traces_and_a_corrupt_file_are_errors(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="is not a folder"):
        doctor.examine(tmp_path / "missing")
    with pytest.raises(InvalidArgumentError, match="holds no rank's trace"):
        doctor.examine(tmp_path)
    (tmp_path / "rank0.config.json").write_text("{not json")
    with pytest.raises(InvalidArgumentError, match=r"rank0\.config\.json is not a shardline"):
        doctor.examine(tmp_path)
