"""Deterministic mode on a GPU: a sample's gradient does not depend on the batch around it.

One GPU stands in for the ranks: a batch's gradients equal the tree of its halves' (and of its
quarters'), as DDP on 2 or 4 GPUs would sum them, in fp32 and under bf16 autocast, with 512
positions; without ``kernels``' settings the same comparison fails (the control).
The main job on 2 GPUs (DDP, ZeRO-3, a 2-stage pipeline, 2-way tensor parallelism) checks the
same against its single-process replay.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from shardline.parallel.deterministic import attention, kernels
from tests.gpu._common import ROOT

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (the GPU host: pytest tests/gpu)"
)


def _run(args: list[str], timeout: float) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "python"), str(ROOT)])}
    for name in kernels.CUBLAS_ENV:
        env.pop(name, None)  # make_deterministic sets them itself
    proc = subprocess.run(
        [sys.executable, *args], env=env, capture_output=True, text=True, timeout=timeout,
        check=False,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    return out


@pytest.mark.timeout(300)
def test_a_batch_and_its_parts_give_the_same_bits() -> None:
    out = _run([str(Path(__file__).with_name("_deterministic_worker.py"))], timeout=280)
    lines = [line for line in out.splitlines() if ": differ " in line]
    assert len(lines) == 6, out  # fp32 and bf16: repeat, halves, quarters
    assert all(line.endswith("differ []") for line in lines), out
    print(out)


@pytest.mark.timeout(300)
def test_without_the_kernel_settings_the_parts_differ() -> None:
    """The control: with GPU kernels as they come, the same comparison fails."""
    worker = str(Path(__file__).with_name("_deterministic_worker.py"))
    out = _run([worker, "--without-kernel-settings"], timeout=280)
    lines = [line for line in out.splitlines() if ": differ " in line]
    assert len(lines) == 6, out
    assert not all(line.endswith("differ []") for line in lines), out
    print(out)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("head", [64, 72])  # 72: the kernel pads the head, a slice follows
def test_attention_hooks_the_efficient_kernels_own_node(head: int) -> None:
    """On a GPU the attention runs on the memory-efficient kernel, whose node is found behind
    the output (no rerun on the math backend); its gradients repeat bit for bit, also
    through a second backward of one forward, and the setting is restored after each."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (
        torch.randn(
            2, 4, 256, head, device="cuda", dtype=torch.bfloat16, generator=gen
        ).requires_grad_()
        for _ in range(3)
    )
    before = torch.are_deterministic_algorithms_enabled()
    grads = []
    for _ in range(2):
        with attention.DeterministicAttention():
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        node = attention._kernel_node(out)
        assert node is not None and "EfficientAttention" in node.name(), out.grad_fn
        dy = torch.ones_like(out)
        grads.append(torch.autograd.grad(out, (q, k, v), dy, retain_graph=True))
        assert torch.are_deterministic_algorithms_enabled() == before
        again = torch.autograd.grad(out, (q, k, v), dy)
        for a, b in zip(grads[-1], again, strict=True):
            assert torch.equal(a, b)
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)


@pytest.mark.timeout(600)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (the 2-GPU host)")
@pytest.mark.parametrize(
    "layout",
    [[], ["--strategy", "zero3"], ["--strategy", "pp"], ["--tp", "2"]],
    ids=["ddp", "zero3", "pp", "tp2"],
)
def test_the_main_job_on_two_gpus_ends_with_one_process_bits(layout: list[str]) -> None:
    args = ["-m", "shardline", "run", "--nproc-per-node", "2", "-m", "shardline.examples.train",
            "--device", "cuda", "--deterministic", "--steps", "30", *layout]  # fmt: skip
    out = _run(args, timeout=560)
    assert "the same bits" in out, out
    print(out)
