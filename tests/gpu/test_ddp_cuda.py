"""DDP on CUDA: shardline's DDP on the nccl backend equals torch's DDP on NCCL (2 GPUs)."""

from __future__ import annotations

import pytest
import torch

from tests.gpu._common import run_worker

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="needs 2 CUDA GPUs (run on the 2-GPU host: pytest tests/gpu)",
)


@pytest.mark.timeout(240)
def test_ddp_matches_torch_ddp_on_nccl() -> None:
    code, out = run_worker("_ddp_worker.py")
    assert code == 0, out
    assert out.count("max |ours - torch|") == 2, out
    print(out)
