"""ZeRO-3 on CUDA: our zero3 on the nccl backend equals torch's FSDP2 and peaks no higher."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.multiprocess._launch import free_port

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="needs 2 CUDA GPUs (run on the 2-GPU host: pytest tests/gpu)",
)

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(240)
def test_zero3_matches_fsdp2_on_nccl_with_no_more_memory() -> None:
    env = {
        **os.environ,
        "TORCH_PORT": str(free_port()),
        "PYTHONPATH": os.pathsep.join(
            [str(Path(__import__("shardline").__file__).parents[1]), str(ROOT)]
        ),
    }
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "shardline",
            "run",
            "--nproc-per-node",
            "2",
            str(Path(__file__).with_name("_zero_worker.py")),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=200,
        check=False,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert out.count("max |ours - fsdp2|") == 2, out
    print(out)
