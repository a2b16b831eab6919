"""More ranks than GPUs, started without our launcher: the healthy ranks stop at once.

``GPUS + 2`` ranks with ``SHARDLINE_BACKEND=nccl`` on a host with ``GPUS`` GPUs (plain env://,
as srun or a scheduler would start them): the last two fail in ``init`` ("selects cuda:N but
this host has GPUS GPU(s)"); every other rank, waiting to set up NCCL, must raise within 5 s
naming a failed rank and its error, not at the deadline (``SHARDLINE_TIMEOUT=120``).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from tests.multiprocess._launch import finish, report, start

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.skipif(GPUS < 1, reason="needs a CUDA GPU (run on a GPU host: pytest tests/gpu)"),
]

WORKER = Path(__file__).parents[1] / "multiprocess" / "_liveness_worker.py"
FAILED = re.compile(r"^FAILED ([0-9.]+) (\w+): (.*)$", re.MULTILINE)


def test_ranks_without_a_gpu_stop_the_others_within_5_s() -> None:
    n = GPUS + 2
    env = {"SHARDLINE_BACKEND": "nccl", "SHARDLINE_DEVICE": "", "SHARDLINE_TIMEOUT": "120"}
    ranks = finish(start(n, "join", env=env, worker=WORKER), timeout=100)
    text = report(ranks)
    got = {r.rank: FAILED.search(r.out) for r in ranks}
    assert all(got.values()) and all(r.rc == 1 for r in ranks), text
    failed_at = []
    for r in range(GPUS, n):
        m = got[r]
        assert m and m.group(2) == "ShardlineError", text
        assert f"selects cuda:{r} but this host has {GPUS} GPU(s)" in m.group(3), text
        failed_at.append(float(m.group(1)))
    for r in range(GPUS):
        m = got[r]
        assert m and m.group(2) == "PeerLostError", text
        assert re.search(r"rank \d+ failed while joining the job", m.group(3)), text
        assert "selects cuda:" in m.group(3), text
        late = float(m.group(1)) - min(failed_at)
        print(f"rank {r}: PeerLostError {late:.2f} s after the first failure")
        assert late < 5.0, (r, late, text)
