"""Tensor parallelism composed on a mesh over NCCL equals one process (4 GPUs)."""

from __future__ import annotations

import pytest
import torch

from tests.gpu._common import run_worker

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 4,
    reason="needs 4 CUDA GPUs (the 4-GPU host: pytest tests/gpu)",
)


@pytest.mark.timeout(300)
def test_zero3_by_tp_hsdp_and_pp_by_tp_on_four_gpus_equal_one_process() -> None:
    code, out = run_worker("_tensor_mesh_worker.py", nproc=4, timeout=280)
    assert code == 0, out
    assert out.count("max |mesh - one process|") == 12, out
    print(out)
