"""A pipeline on 2 GPUs over NCCL equals one process (TinyGPT, tied embedding and head); on 4,
so do ZeRO-3 replicas of a 2-stage pipeline (dp=2 x pp=2)."""

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


@pytest.mark.timeout(240)
@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 CUDA GPUs (the 4-GPU host)")
def test_zero3_replicas_of_a_pipeline_on_four_gpus_equal_one_process() -> None:
    code, out = run_worker("_pipeline_mesh_worker.py", nproc=4)
    assert code == 0, out
    assert out.count("max |dp x pp - one process|") == 4, out
    print(out)
