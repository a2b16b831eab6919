"""Repeatable mode on GPUs: two fresh runs of one layout end with the same bits.

A small GPT in bf16 (ZeRO-3; on 2 GPUs where the host has them, whose sums then go through
the tree group over NCCL) trains 3 steps in fresh processes, twice per case.
``deterministic="repeat"`` must give one hash, with attention on torch's choice of kernel
(cuDNN's on an H200), on the flash kernel and on the memory-efficient one. The control: with
torch's kernels as they come, the flash kernel's backward adds with atomics (on an H200 its
gradients differed in each of 20 repeats of one batch), and two runs end apart.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.gpu._common import ROOT
from tests.multiprocess._launch import free_port

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (the GPU host: pytest tests/gpu)"
)


def _hashes(mode: str, attention: str, runs: int = 2) -> list[str]:
    nproc = min(2, torch.cuda.device_count())
    out = []
    for _ in range(runs):
        env = {
            **os.environ,
            "TORCH_PORT": str(free_port()),
            "PYTHONPATH": os.pathsep.join([str(ROOT / "python"), str(ROOT)]),
        }
        env.pop("CUBLAS_WORKSPACE_CONFIG", None)  # repeatable mode sets it itself
        proc = subprocess.run(
            [sys.executable, "-m", "shardline", "run", "--nproc-per-node", str(nproc),
             str(Path(__file__).with_name("_repeat_worker.py")), "--mode", mode,
             "--attention", attention],
            env=env, capture_output=True, text=True, timeout=200, check=False,
        )  # fmt: skip
        text = proc.stdout + proc.stderr
        assert proc.returncode == 0, text
        lines = [line for line in text.splitlines() if "hash " in line]
        assert len(lines) == 1, text
        out.append(lines[0].split("hash ", 1)[1])
    return out


@pytest.mark.timeout(450)
@pytest.mark.parametrize("attention", ["default", "flash", "efficient"])
def test_two_runs_of_one_layout_end_with_the_same_bits(attention: str) -> None:
    hashes = _hashes("repeat", attention)
    assert len(set(hashes)) == 1, hashes
    print(hashes)


@pytest.mark.timeout(450)
def test_without_it_two_runs_differ() -> None:
    """The control: as torch's kernels come, the same two runs end apart."""
    hashes = _hashes("default", "flash")
    assert len(set(hashes)) == 2, hashes
    print(hashes)
