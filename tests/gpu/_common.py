"""What the GPU tests share: launching a worker script, a worker's two groups, and the
pipeline workers' TinyGPT job."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import shardline as sl
from shardline.comm import ProcessGroup
from tests.multiprocess._launch import free_port

ROOT = Path(__file__).resolve().parents[2]


def run_worker(
    script: str,
    timeout: float = 200,
    nproc: int = 2,
    args: Sequence[str] = (),
    unset: Sequence[str] = (),
) -> tuple[int, str]:
    """Runs ``tests/gpu/<script> <args>`` on ``nproc`` ranks via ``shardline run``, with the
    variables ``unset`` left out of its environment: (exit code, output)."""
    env = {
        **os.environ,
        "TORCH_PORT": str(free_port()),
        "PYTHONPATH": os.pathsep.join(
            [str(Path(__import__("shardline").__file__).parents[1]), str(ROOT)]
        ),
    }
    for name in unset:
        env.pop(name, None)
    proc = subprocess.run(
        [sys.executable, "-m", "shardline", "run", "--nproc-per-node", str(nproc),
         str(Path(__file__).with_name(script)), *args],
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


def tiny_gpt_job() -> tuple[torch.device, torch.nn.Module, list[torch.Tensor]]:
    """In a pipeline worker: this rank's GPU and our nccl default group, a TinyGPT (tied
    embedding and head; seed 0) on it, and three batches of 8 sequences; TF32 off, so that a
    pipeline and one process agree to fp32 rounding."""
    from shardline.examples.train import Config, TinyGPT

    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    sl.init(backend="nccl")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    cfg = Config(d_model=256, num_layers=4, num_heads=4, seq_len=128)
    torch.manual_seed(0)
    base = TinyGPT(cfg).to(device)
    gen = torch.Generator().manual_seed(7)
    data = [torch.randint(0, cfg.vocab, (8, cfg.seq_len + 1), generator=gen) for _ in range(3)]
    return device, base, data


def finish(rank: int, failures: list[str]) -> int:
    """A worker's last step: shuts shardline down, names what failed; the exit code."""
    sl.shutdown()
    if failures:
        print(f"rank {rank}: FAILED {failures}", flush=True)
    return 1 if failures else 0
