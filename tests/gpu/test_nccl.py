"""The nccl backend on two GPUs, one process each: collectives against torch references.

Run with ``pytest tests/gpu -q`` on a host with at least two CUDA GPUs; elsewhere the module
is skipped with the reason.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.multiprocess._launch import Rank, finish, report, start

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
if GPUS < 2:
    pytest.skip(f"needs 2 CUDA GPUs (one process each) but found {GPUS}", allow_module_level=True)
if not dist.is_nccl_available():
    pytest.skip("this torch build has no NCCL", allow_module_level=True)

pytestmark = pytest.mark.multiprocess
WORKER = Path(__file__).with_name("_nccl_worker.py")


def run(scenario: str, env: dict[str, str] | None = None, n: int = 2) -> list[Rank]:
    """Runs ``n`` ranks of the worker, rank ``r`` on GPU ``r``; asserts all exit 0 with OK."""
    # An empty SHARDLINE_BACKEND counts as unset: the worker's init() chooses by device.
    env = {"SHARDLINE_TIMEOUT": "60", "SHARDLINE_BACKEND": "", **(env or {})}
    ranks = finish(start(n, scenario, env=env, worker=WORKER), 110)
    assert all(r.rc == 0 and "OK" in r.out for r in ranks), report(ranks)
    return ranks


def test_collectives_on_two_gpus_match_torch() -> None:
    run("collectives", {"SHARDLINE_DEVICE": ""})


def test_edge_checks_reject_cpu_and_foreign_gpu_tensors() -> None:
    run("edge_checks")


def test_shardline_device_cpu_chooses_native_on_a_gpu_host() -> None:
    run("cpu_on_a_gpu_host", {"SHARDLINE_DEVICE": "cpu", "SHARDLINE_HOST_ID": "one-box"})
