"""What the 2-GPU tests share: launching a worker script, and a worker's two groups."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import shardline as sl
from shardline.comm import ProcessGroup
from tests.multiprocess._launch import free_port

ROOT = Path(__file__).resolve().parents[2]


def run_worker(script: str, timeout: float = 200, nproc: int = 2) -> tuple[int, str]:
    """Runs ``tests/gpu/<script>`` on ``nproc`` ranks via ``shardline run``: (exit code,
    output)."""
    env = {
        **os.environ,
        "TORCH_PORT": str(free_port()),
        "PYTHONPATH": os.pathsep.join(
            [str(Path(__import__("shardline").__file__).parents[1]), str(ROOT)]
        ),
    }
    proc = subprocess.run(
        [sys.executable, "-m", "shardline", "run", "--nproc-per-node", str(nproc),
         str(Path(__file__).with_name(script))],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )  # fmt: skip
    return proc.returncode, proc.stdout + proc.stderr


def init_both() -> tuple[ProcessGroup, int, int, torch.device]:
    """In a worker: our nccl group and torch's NCCL default group, on this rank's GPU."""
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    group = sl.init(backend="nccl")
    rank, world = group.rank, group.world_size
    store = dist.TCPStore(
        "127.0.0.1", int(os.environ["TORCH_PORT"]), world, rank == 0, timedelta(seconds=60)
    )
    dist.init_process_group("nccl", store=store, rank=rank, world_size=world)
    return group, rank, world, torch.device("cuda", local)
