"""The timeline of a traced NCCL job: each op at the time it ran on the GPU, not when queued.

Run with ``pytest tests/gpu -q`` on a host with a CUDA GPU (two ranks where it has two GPUs,
else one); elsewhere the module is skipped with the reason. Each rank queues matrix products
and an all-reduce behind them: the host returns from queuing at once, the GPU starts the
all-reduce only when the products end. The host's own clock, waiting for the products,
is the reference.
"""

from __future__ import annotations

import itertools
import json
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from shardline.comm import flight
from shardline.comm.trace import doctor, folder, merge
from tests.multiprocess._launch import finish, report, start

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
if GPUS < 1:
    pytest.skip("needs a CUDA GPU, found none", allow_module_level=True)
if not dist.is_nccl_available():
    pytest.skip("this torch build has no NCCL", allow_module_level=True)

pytestmark = pytest.mark.multiprocess
WORKER = Path(__file__).with_name("_trace_worker.py")
STEPS_WORKER = Path(__file__).with_name("_trace_steps_worker.py")
BACKWARD_WORKER = Path(__file__).with_name("_trace_backward_worker.py")


def test_nccl_ops_land_on_the_timeline_at_their_gpu_times(tmp_path: Path) -> None:
    n = min(GPUS, 2)
    env = {"SHARDLINE_TIMEOUT": "60", "SHARDLINE_BACKEND": "", "SHARDLINE_TRACE": str(tmp_path)}
    ranks = finish(start(n, env=env, args=[str(WORKER)]), 120)
    assert all(r.rc == 0 and "OK" in r.out for r in ranks), report(ranks)
    loaded = folder.load(tmp_path)
    for r in ranks:
        seen = json.loads(next(x for x in r.out.splitlines() if x.startswith("{")))
        big = [o for o in loaded[r.rank].ops if o[flight.OP] == "all_reduce"
               and o[flight.NUMEL] == 16 << 20]  # fmt: skip
        assert len(big) == 2, big
        for op, name in zip(big, ("async", "blocking"), strict=True):
            on_gpu = folder.device_span(op)
            assert on_gpu is not None, f"rank {r.rank}: {name} all-reduce has no device time"
            start_s, end_s = on_gpu
            host = seen[name]
            # Queued at once on the host; run on the GPU only after the products ended, as
            # the host saw them end (within its wait's latency and the clock's calibration).
            assert op[flight.START] == pytest.approx(host["queued"], abs=2e-3)
            assert start_s - host["queued"] > 0.01, (r.rank, name, start_s, host)
            assert start_s == pytest.approx(host["products_done"], abs=5e-3), (r.rank, name)
            assert 0 < end_s - start_s < 1.0
    doc = merge.chrome_trace(tmp_path)
    gpu = {(e["pid"], e["tid"]) for e in doc["traceEvents"] if e.get("cat") == "gpu"}
    assert {pid for pid, _ in gpu} == set(range(n)), gpu
    assert doctor.examine(tmp_path).findings == []


def test_the_backwards_ops_on_the_autograd_thread_are_placed_at_its_line(tmp_path: Path) -> None:
    """DDP's all-reduces, issued from hooks on torch's autograd thread of the GPU (no frame of
    the program's there), carry the program's ``loss.backward()`` line."""
    n = min(GPUS, 2)
    env = {"SHARDLINE_TIMEOUT": "60", "SHARDLINE_BACKEND": "", "SHARDLINE_TRACE": str(tmp_path)}
    ranks = finish(start(n, env=env, args=[str(BACKWARD_WORKER)]), 120)
    assert all(r.rc == 0 and "OK" in r.out for r in ranks), report(ranks)
    text = BACKWARD_WORKER.read_text().splitlines()
    line = next(i for i, x in enumerate(text, 1) if "# the backward's line" in x)
    loaded = folder.load(tmp_path)
    for r in ranks:
        seen = json.loads(next(x for x in r.out.splitlines() if x.startswith("{")))
        assert seen["hooks_on_main"] == [False] * 3, seen  # the path this test is about
        reduces = [o for o in loaded[r.rank].ops if o[flight.OP] == "all_reduce"]
        assert len(reduces) >= 2 * 3, reduces  # buckets of 10 KB: several a backward
        where = f"{os.sep}{BACKWARD_WORKER.name}:{line}"
        assert all(str(o[flight.WHERE]).endswith(where) for o in reduces), reduces


def test_the_doctor_asks_a_live_job_for_gpu_times_on_every_step(tmp_path: Path) -> None:
    """With GPU times on one step in 16, the doctor asks the running job for 10 steps: every
    all-reduce of those steps, and of no step between the sampled ones, has GPU times."""
    n = min(GPUS, 2)
    env = {"SHARDLINE_TIMEOUT": "60", "SHARDLINE_BACKEND": "", "SHARDLINE_TRACE": str(tmp_path),
           "SHARDLINE_TRACE_GPU": "16", "SHARDLINE_TRACE_INTERVAL": "0.2"}  # fmt: skip
    ranks = start(n, env=env, args=[str(STEPS_WORKER)])
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and not all(
            (b := _beat(tmp_path, r)) and b.get("steps_written", 0) >= 20 for r in range(n)
        ):
            time.sleep(0.2)
        rep = doctor.diagnose(tmp_path, steps=10, wait=60)
    finally:
        (tmp_path / "stop").touch()
        ranks = finish(ranks, 120)
    assert all(r.rc == 0 and "OK" in r.out for r in ranks), report(ranks)
    assert any(x.startswith("GPU times on every step of the last 10") for x in rep.notes), rep
    loaded = folder.load(tmp_path)
    for r in range(n):
        asked = _beat(tmp_path, r)["asked"]
        marks = loaded[r].steps
        timed = {m["n"] for m in marks if m.get("gpu")}
        assert set(range(asked["from"], asked["until"])) <= timed
        assert timed == {m["n"] for m in marks if m["n"] % 16 == 0
                         or asked["from"] <= m["n"] < asked["until"]}  # fmt: skip
        ops = [o for o in loaded[r].ops if o[flight.OP] == "all_reduce"]
        for a, b in itertools.pairwise(marks):  # an op belongs to the step it ended in
            inside = [o for o in ops if a["t1"] < o[flight.END] <= b["t1"]]
            assert inside, (r, b["n"])
            spans = [folder.device_span(o) is not None for o in inside]
            assert spans == [b["n"] in timed] * len(inside), (r, b["n"], spans)


def _beat(folder_: Path, r: int) -> dict[str, object] | None:
    try:
        return dict(json.loads((folder_ / f"rank{r}.now.json").read_text()))
    except (OSError, ValueError):
        return None
