"""Micro-batch mode on GPUs: every layout's bits, on the model's own kernels.

On one GPU, a small GPT's 3 AdamW steps of 4 micro-batches each under DDP, ZeRO-1 and ZeRO-3
(``deterministic="microbatch"``) must end with exactly the parameters of plain PyTorch
adding each micro-batch's gradient, computed alone, in the canonical tree: in fp32 and under
bf16 autocast. That checks that a wrapper's parameters (ZeRO's views of its flat buffers)
give the kernels' bits of plain ones. On two GPUs (NCCL, 2 micro-batches a rank) every case,
bf16 parameters under ZeRO-3 too, must end with one GPU's hash.
"""

from __future__ import annotations

import re

import pytest
import torch

from tests.gpu._common import run_worker

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (the GPU host: pytest tests/gpu)"
)


def _hashes(nproc: int, autocast: bool) -> dict[str, str]:
    rc, text = run_worker(
        "_microbatch_worker.py", timeout=300, nproc=nproc,
        args=["--autocast"] if autocast else [],
        unset=["CUBLAS_WORKSPACE_CONFIG"],  # the mode sets it itself
    )  # fmt: skip
    assert rc == 0, text
    # (the launcher may prefix a rank's lines)
    return dict(re.findall(r"case (\S+) hash ([0-9a-f]+)", text))


@pytest.mark.timeout(360)
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_one_gpu_matches_plain_pytorch_adding_the_micro_batches_in_the_tree(
    autocast: bool,
) -> None:
    got = _hashes(1, autocast)
    assert set(got) == {"oracle", "ddp", "zero1", "zero3", "zero3-bf16"}, got
    for case in ("ddp", "zero1", "zero3"):
        assert got[case] == got["oracle"], (case, got)
    assert got["zero3-bf16"] != got["oracle"]  # bf16 parameters: other bits (and not blind)


@pytest.mark.timeout(360)
@pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs 2 GPUs (2 ranks over NCCL); this host has 1"
)
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_two_gpus_end_with_one_gpus_bits(autocast: bool) -> None:
    one, two = _hashes(1, autocast), _hashes(2, autocast)
    del one["oracle"]
    assert two == one
