"""Communication-efficient training on CUDA (2 GPUs, our nccl backend): local and async SGD
equal torch's DDP where they must, and every compressor keeps replicas identical."""

from __future__ import annotations

import pytest
import torch

from tests.gpu._common import run_worker

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="needs 2 CUDA GPUs (run on the 2-GPU host: pytest tests/gpu)",
)


@pytest.mark.timeout(300)
def test_local_async_and_compressed_ddp_on_nccl() -> None:
    code, out = run_worker("_optim_worker.py", timeout=280)
    assert code == 0, out
    assert out.count("max |ours - torch DDP|") == 2 * 3, out
    assert out.count("replicas equal True") == 2 * 5, out
    print(out)
