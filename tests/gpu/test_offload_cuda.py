"""ZeRO offload on CUDA (2 GPUs, our nccl backend): zero3 with its shards and optimizer state
in pinned host memory trains like zero3 on the GPUs."""

from __future__ import annotations

import pytest
import torch

from tests.gpu._common import run_worker

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="needs 2 CUDA GPUs (run on the 2-GPU host: pytest tests/gpu)",
)


@pytest.mark.timeout(300)
def test_offloaded_zero3_trains_like_zero3_on_the_gpus() -> None:
    code, out = run_worker("_offload_worker.py", timeout=280)
    assert code == 0, out
    assert out.count("state on host True") == 2 * 3, out
    assert out.count("model passed in host memory") == 2, out
    print(out)
