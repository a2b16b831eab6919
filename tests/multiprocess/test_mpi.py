"""The mpi backend under a real ``mpirun``: collectives against torch, and rank checks.

Skipped (with the reason) where mpi4py or an ``mpirun`` is missing: install them with
``pip install shardline[mpi]`` and an MPI library (``apt-get install libopenmpi-dev
openmpi-bin``).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.multiprocess._launch import PYTHONPATH

MPIRUN = shutil.which("mpirun") or shutil.which("mpiexec")
pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.skipif(
        importlib.util.find_spec("mpi4py") is None,
        reason="mpi4py is not installed (pip install shardline[mpi], plus an MPI library)",
    ),
    pytest.mark.skipif(MPIRUN is None, reason="no mpirun/mpiexec on PATH (install Open MPI)"),
]
WORKER = Path(__file__).with_name("_mpi_worker.py")
# Variables of other launchers, which would make init() read a rendezvous of their own.
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR")


def mpirun(n: int, scenario: str, extra_env: dict[str, str] | None = None) -> list[str]:
    """Runs ``n`` ranks of the worker under mpirun; returns each rank's output lines."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env.update(
        PYTHONPATH=PYTHONPATH,
        SHARDLINE_TIMEOUT="30",
        # Open MPI: allow root (containers, CI) and more ranks than cores.
        OMPI_ALLOW_RUN_AS_ROOT="1",
        OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
        OMPI_MCA_rmaps_base_oversubscribe="1",
        **(extra_env or {}),
    )
    assert MPIRUN is not None
    proc = subprocess.run(
        [MPIRUN, "-n", str(n), sys.executable, str(WORKER), scenario],
        env=env,
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    report = f"rc={proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert proc.returncode == 0, report
    lines = [line for line in proc.stdout.splitlines() if line.startswith(("OK", "ERROR"))]
    assert len(lines) == n, report
    return lines


def test_collectives_match_torch_on_two_mpi_ranks() -> None:
    assert mpirun(2, "collectives") == ["OK", "OK"]


def test_rendezvous_that_disagrees_with_mpi_fails_on_every_rank() -> None:
    lines = mpirun(2, "mismatch", {"RANK": "0", "WORLD_SIZE": "2"})
    assert all(line.startswith("ERROR ShardlineError") for line in lines), lines
    assert all("MPI rank 1 has rank 0 of 2" in line for line in lines), lines
