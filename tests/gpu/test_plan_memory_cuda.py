"""The memory planner on CUDA: each ZeRO choice's predicted peak within 10 % of the measured."""

from __future__ import annotations

import pytest
import torch

from tests.gpu._common import run_worker

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the GPU host: pytest tests/gpu)"
)


@pytest.mark.timeout(300)
def test_the_planners_peak_is_within_ten_percent_of_the_allocators() -> None:
    ranks = min(2, torch.cuda.device_count())
    code, out = run_worker("_plan_memory_worker.py", timeout=280, nproc=ranks)
    assert code == 0, out
    assert out.count("ratio") == 6 * ranks, out
    print(out)
