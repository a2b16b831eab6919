"""A pipeline on 2 GPUs over NCCL equals one process (TinyGPT, tied embedding and head)."""

from __future__ import annotations

import pytest
import torch

from tests.gpu._common import run_worker

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="needs 2 CUDA GPUs (run on the 2-GPU host: pytest tests/gpu)",
)


@pytest.mark.timeout(240)
def test_a_two_gpu_pipeline_equals_one_process() -> None:
    code, out = run_worker("_pipeline_worker.py")
    assert code == 0, out
    assert out.count("max |pipeline - one process|") == 6, out
    print(out)
