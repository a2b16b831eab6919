"""ZeRO-3 on CUDA: our zero3 on the nccl backend equals torch's FSDP2 and peaks no higher."""

from __future__ import annotations

import pytest
import torch

from tests.gpu._common import run_worker

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="needs 2 CUDA GPUs (run on the 2-GPU host: pytest tests/gpu)",
)


@pytest.mark.timeout(240)
def test_zero3_matches_fsdp2_on_nccl_with_no_more_memory() -> None:
    code, out = run_worker("_zero_worker.py")
    assert code == 0, out
    assert out.count("max |ours - fsdp2|") == 2, out
    assert out.count("max |selective - zero3|") == 2, out
    print(out)


@pytest.mark.timeout(240)
def test_adafactor_gets_whole_parameters_on_nccl_and_equals_one_process() -> None:
    code, out = run_worker("_zero_optimizers_worker.py")
    assert code == 0, out
    assert out.count("max |ours - one process|") == 6, out
    print(out)
