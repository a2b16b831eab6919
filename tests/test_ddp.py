"""DDP against its oracles: torch's DDP on Gloo, and one process training on the full batch.

Ranks run as threads; torch's DDP gets a real ``ProcessGroupGloo`` per thread, so both run the
same model, seed and data split side by side in one rank. How buckets are built and started:
``test_ddp_mechanics.py``.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from shardline.comm import ProcessGroup
from shardline.errors import ShardlineError
from shardline.parallel import DistributedDataParallel
from tests._ddp import (
    BUCKET_IDS,
    BUCKETS,
    HIDDEN,
    IN,
    INIT_LOCK,
    OUT,
    assert_equal_lists,
    batch,
    mlp,
    params,
    side_by_side,
    train,
)
from tests._ranks import run_ranks
from tests.multiprocess._launch import report
from tests.multiprocess._launch import run as run_processes

pytestmark = pytest.mark.usefixtures("native")

# -- parity ------------------------------------------------------------------------------------


@pytest.mark.parametrize("buckets", BUCKETS, ids=BUCKET_IDS)
@pytest.mark.parametrize("n", [2, 3, 4])
def test_matches_torch_ddp(n: int, backend: str, buckets: dict[str, Any]) -> None:
    """Bitwise at 2 ranks (a sum of two numbers), assert_close at 3 and 4; several buckets,
    gradients copied into buckets or reduced in place."""

    def run(model: nn.Module, rank: int) -> tuple[list[list[torch.Tensor]], list[torch.Tensor]]:
        grads: list[list[torch.Tensor]] = []
        train(model, rank, steps=4, record=grads)
        return grads, params(model)

    results = side_by_side(
        n,
        lambda g: DistributedDataParallel(mlp(), group=g, bucket_cap_mb=0.001, **buckets),
        lambda pg: TorchDDP(mlp(), process_group=pg, bucket_cap_mb=0.001),
        run,
        backend=backend,
    )
    for ours, theirs in results:
        (g_ours, p_ours), (g_theirs, p_theirs) = ours, theirs  # type: ignore[misc]
        for a, b in zip(g_ours, g_theirs, strict=True):
            assert_equal_lists(a, b, exact=n == 2)
        assert_equal_lists(p_ours, p_theirs, exact=n == 2)
    # Every replica holds the same model.
    first = results[0][0][1]  # type: ignore[index]
    for ours, _ in results[1:]:
        assert_equal_lists(ours[1], first, exact=True)  # type: ignore[index]


@pytest.mark.parametrize("n", [2, 4])
def test_equals_single_process_on_the_full_batch(n: int) -> None:
    steps, rows = 3, 6

    def body(g: ProcessGroup) -> list[torch.Tensor]:
        torch.set_num_threads(1)
        model = DistributedDataParallel(mlp(), group=g, bucket_cap_mb=0.002)
        train(model, g.rank, steps, rows=rows)
        return params(model)

    results = run_ranks(n, body)

    reference = mlp()
    opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        xs, ys = zip(*(batch(step, r, rows) for r in range(n)), strict=True)
        opt.zero_grad()
        nn.functional.mse_loss(reference(torch.cat(xs)), torch.cat(ys)).backward()
        opt.step()
    for ours in results:
        assert_equal_lists(ours, params(reference), exact=False)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_gradient_as_bucket_view_changes_nothing(set_to_none: bool) -> None:
    """Grads that alias the buckets (default) equal copied-back ones, with and without
    zero_grad(set_to_none), across no_sync accumulation and several steps."""

    def run(model: nn.Module, rank: int) -> tuple[list[list[torch.Tensor]], list[torch.Tensor]]:
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        grads = []
        for step in range(3):
            opt.zero_grad(set_to_none=set_to_none)
            with model.no_sync():  # type: ignore[operator]
                x, y = batch(10 + step, rank)
                nn.functional.mse_loss(model(x), y).backward()
            x, y = batch(step, rank)
            nn.functional.mse_loss(model(x), y).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
            opt.step()
        return grads, params(model)

    def body(g: ProcessGroup) -> tuple[object, object]:
        torch.set_num_threads(1)
        a = run(DistributedDataParallel(mlp(), group=g, bucket_cap_mb=0.001), g.rank)
        b = run(
            DistributedDataParallel(
                mlp(), group=g, bucket_cap_mb=0.001, gradient_as_bucket_view=False
            ),
            g.rank,
        )
        return a, b

    for (g_view, p_view), (g_copy, p_copy) in run_ranks(2, body):  # type: ignore[misc]
        for a, b in zip(g_view, g_copy, strict=True):
            assert_equal_lists(a, b, exact=True)
        assert_equal_lists(p_view, p_copy, exact=True)


@pytest.mark.parametrize("buckets", BUCKETS[1:], ids=BUCKET_IDS[1:])
def test_each_gradient_is_its_bucket_slot_once_copied(buckets: dict[str, Any]) -> None:
    """With gradient_as_bucket_view, a gradient copied into its bucket is that slot from then
    on, while backward still runs (autograd's own tensor is let go there, not at the end of
    backward); without it the parameter keeps autograd's tensor until the write-back."""

    def seen(model: DistributedDataParallel) -> list[bool]:
        # Runs after the wrapper's hook (registered later): is the gradient in a bucket now?
        found: list[bool] = []

        def hook(p: torch.Tensor) -> None:
            flats = {b.flat.untyped_storage().data_ptr() for b in model._buckets}
            assert p.grad is not None
            found.append(p.grad.untyped_storage().data_ptr() in flats)

        for p in model.parameters():
            p.register_post_accumulate_grad_hook(hook)  # type: ignore[no-untyped-call]
        return found

    def body(g: ProcessGroup) -> tuple[list[bool], list[bool]]:
        torch.set_num_threads(1)
        runs = []
        for as_view in (True, False):
            model = DistributedDataParallel(
                mlp(), group=g, bucket_cap_mb=0.001, gradient_as_bucket_view=as_view, **buckets
            )
            found = seen(model)
            train(model, g.rank, steps=3)  # zero_grad() sets them to None each step
            runs.append(found)
        return runs[0], runs[1]

    n_params = len(list(mlp().parameters()))
    for as_view, copied in run_ranks(2, body):
        assert as_view == [True] * 3 * n_params
        assert copied == [False] * 3 * n_params


def test_batchnorm_buffers_follow_torch() -> None:
    """Buffers are broadcast from rank 0 before each forward, as torch's DDP does."""

    def run(model: nn.Module, rank: int) -> list[torch.Tensor]:
        train(model, rank, steps=3)
        return params(model)  # includes running_mean / running_var / num_batches_tracked

    results = side_by_side(
        2,
        lambda g: DistributedDataParallel(mlp(batchnorm=True), group=g),
        lambda pg: TorchDDP(mlp(batchnorm=True), process_group=pg),
        run,
    )
    for ours, theirs in results:
        assert_equal_lists(ours, theirs, exact=True)  # type: ignore[arg-type]
    # Rank-local statistics of the last forward differ, which proves they were not averaged.
    running_mean = 4  # state_dict: 0.weight, 0.bias, 1.weight, 1.bias, 1.running_mean, ...
    assert not torch.equal(results[0][0][running_mean], results[1][0][running_mean])  # type: ignore[index]


class Branchy(nn.Module):
    """Rank 0 uses ``left``, rank 1 uses ``right``; nobody ever uses ``never``."""

    def __init__(self) -> None:
        super().__init__()
        with INIT_LOCK:
            torch.manual_seed(3)
            self.trunk = nn.Linear(IN, HIDDEN)
            self.left = nn.Linear(HIDDEN, OUT)
            self.right = nn.Linear(HIDDEN, OUT)
            self.never = nn.Linear(HIDDEN, OUT)
        self.branch = "left"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        head = self.left if self.branch == "left" else self.right
        return head(torch.relu(self.trunk(x)))


@pytest.mark.parametrize("buckets", BUCKETS, ids=BUCKET_IDS)
def test_unused_parameters_need_no_flag(buckets: dict[str, Any]) -> None:
    """Equal to torch's DDP with find_unused_parameters=True, which needs the flag."""

    def make(rank: int) -> Branchy:
        m = Branchy()
        m.branch = "left" if rank == 0 else "right"
        return m

    def run(model: nn.Module, rank: int) -> tuple[list[object], list[torch.Tensor]]:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        grads: list[object] = []
        for step in range(3):
            x, y = batch(step, rank)
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            grads.append([None if p.grad is None else p.grad.clone() for p in model.parameters()])
            opt.step()
        return grads, params(model)

    results = side_by_side(
        2,
        lambda g: DistributedDataParallel(make(g.rank), group=g, **buckets),
        lambda pg: TorchDDP(make(pg.rank()), process_group=pg, find_unused_parameters=True),
        run,
    )
    for (g_ours, p_ours), (g_theirs, p_theirs) in results:  # type: ignore[misc]
        for a, b in zip(g_ours, g_theirs, strict=True):
            assert [t is None for t in a] == [t is None for t in b]
            assert_equal_lists(
                [t for t in a if t is not None], [t for t in b if t is not None], True
            )
        assert_equal_lists(p_ours, p_theirs, exact=True)
    # ``never`` got no gradient anywhere and stays None; both heads were trained everywhere.
    last = results[0][0][0][-1]  # type: ignore[index]
    assert last[-1] is None and last[-2] is None and last[2] is not None and last[4] is not None


@pytest.mark.parametrize("buckets", BUCKETS, ids=BUCKET_IDS)
def test_no_sync_accumulation_equals_one_big_batch(buckets: dict[str, Any]) -> None:
    def body(g: ProcessGroup) -> list[torch.Tensor]:
        torch.set_num_threads(1)
        model = DistributedDataParallel(mlp(), group=g, bucket_cap_mb=0.001, **buckets)
        (x1, y1), (x2, y2) = batch(0, g.rank), batch(1, g.rank)
        with model.no_sync():
            (nn.functional.mse_loss(model(x1), y1, reduction="sum")).backward()
        (nn.functional.mse_loss(model(x2), y2, reduction="sum")).backward()
        return [p.grad.clone() for p in model.parameters()]

    results = run_ranks(2, body)
    reference = mlp()
    for r in range(2):
        for s in range(2):
            x, y = batch(s, r)
            (nn.functional.mse_loss(reference(x), y, reduction="sum") / 2).backward()
    expected = [p.grad for p in reference.parameters()]
    for grads in results:
        assert_equal_lists(grads, expected, exact=False)


@pytest.mark.parametrize("counts", [[2, 5], [5, 2], [0, 3], [3, 3]])
@pytest.mark.parametrize("buckets", BUCKETS, ids=BUCKET_IDS)
def test_join_uneven_inputs(buckets: dict[str, Any], counts: list[int]) -> None:
    """Ranks with different numbers of batches (none at all, too): no hang, and torch's Join
    semantics exactly.

    torch's ``Join`` needs a default process group, so the oracle is a one-process simulation
    of its documented semantics: buffers come from the highest rank still training, gradients
    are divided by the initial world size, joined ranks contribute zeros and stop stepping,
    and at the end everyone takes the model of the last rank to finish.
    """

    def body(g: ProcessGroup) -> list[torch.Tensor]:
        torch.set_num_threads(1)
        model = DistributedDataParallel(
            mlp(batchnorm=True), group=g, bucket_cap_mb=0.001, **buckets
        )
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        with model.join():
            for step in range(counts[g.rank]):
                x, y = batch(step, g.rank)
                opt.zero_grad()
                nn.functional.mse_loss(model(x), y).backward()
                opt.step()
        return params(model)

    results = run_ranks(2, body)

    expected = single_threaded(lambda: simulate_join(counts))
    for ours in results:
        assert_equal_lists(ours, expected, exact=True)


def single_threaded(fn: Callable[[], list[torch.Tensor]]) -> list[torch.Tensor]:
    """Runs ``fn`` in a fresh thread with one intra-op thread, like the rank threads
    (bitwise comparisons need the same matmul blocking)."""
    out: list[list[torch.Tensor]] = []

    def run() -> None:
        torch.set_num_threads(1)
        out.append(fn())

    t = threading.Thread(target=run)
    t.start()
    t.join(60)
    assert out, "reference computation failed or timed out"
    return out[0]


def simulate_join(counts: list[int]) -> list[torch.Tensor]:
    replicas = [mlp(batchnorm=True), mlp(batchnorm=True)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in replicas]
    last = 0  # the highest rank still training in the last round
    for step in range(max(counts)):
        active = [r for r in range(2) if step < counts[r]]
        src = last = max(active)
        grads = []
        for r in active:
            for mine, theirs in zip(replicas[r].buffers(), replicas[src].buffers(), strict=True):
                mine.copy_(theirs)
            replicas[r].zero_grad()
            x, y = batch(step, r)
            nn.functional.mse_loss(replicas[r](x), y).backward()
            grads.append([p.grad * 0.5 for p in replicas[r].parameters()])
        total = [sum(parts[1:], parts[0]) for parts in zip(*grads, strict=True)]
        for r in active:
            for p, gsum in zip(replicas[r].parameters(), total, strict=True):
                p.grad = gsum.clone()
            opts[r].step()
    return params(replicas[last])


@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_compression_hooks_within_tolerance(name: str) -> None:
    torch_hook = {
        "bf16": default_hooks.bf16_compress_hook,
        "fp16": default_hooks.fp16_compress_hook,
    }[name]

    def theirs(pg: dist.ProcessGroup) -> nn.Module:
        m = TorchDDP(mlp(), process_group=pg)
        m.register_comm_hook(pg, torch_hook)
        return m

    def run(model: nn.Module, rank: int) -> list[list[torch.Tensor]]:
        grads: list[list[torch.Tensor]] = []
        train(model, rank, steps=2, record=grads)
        return grads

    exact = side_by_side(
        2,
        lambda g: DistributedDataParallel(mlp(), group=g),
        lambda pg: TorchDDP(mlp(), process_group=pg),
        run,
    )
    compressed = side_by_side(
        2, lambda g: DistributedDataParallel(mlp(), group=g, comm_hook=name), theirs, run
    )
    tol = {"bf16": 2e-2, "fp16": 2e-3}[name]
    for (ours_c, theirs_c), (ours_e, _) in zip(compressed, exact, strict=True):
        for step_c, step_t, step_e in zip(ours_c, theirs_c, ours_e, strict=True):  # type: ignore[call-overload]
            for a, b, e in zip(step_c, step_t, step_e, strict=True):
                torch.testing.assert_close(a, b, rtol=tol, atol=tol * 0.1)
                torch.testing.assert_close(a, e, rtol=tol, atol=tol * 0.1)
        # Compression really happened: some gradient of the first step differs from exact.
        assert any(
            not torch.equal(a, e)
            for a, e in zip(ours_c[0], ours_e[0], strict=True)  # type: ignore[index]
        )


@pytest.mark.parametrize("buckets", BUCKETS, ids=BUCKET_IDS)
def test_gradient_nobody_used_is_left_alone(buckets: dict[str, Any]) -> None:
    """Gradients kept across steps (no zero_grad) of a head no rank uses stay bit for bit."""

    def body(g: ProcessGroup) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        torch.set_num_threads(1)
        model = DistributedDataParallel(Branchy(), group=g, **buckets)
        inner = model.module
        assert isinstance(inner, Branchy)
        for step in range(3):  # past the bucket rebuild, so grads alias buckets
            x, y = batch(step, g.rank)
            nn.functional.mse_loss(model(x), y).backward()
        kept = [inner.left.weight.grad.clone(), inner.left.bias.grad.clone()]
        inner.branch = "right"  # nobody uses ``left`` any more; grads are not zeroed
        x, y = batch(9, g.rank)
        nn.functional.mse_loss(model(x), y).backward()
        return kept, [inner.left.weight.grad, inner.left.bias.grad]

    for kept, after in run_ranks(3, body):
        assert_equal_lists(after, kept, exact=True)


def test_no_sync_is_decided_at_forward_time() -> None:
    """A forward inside no_sync() keeps its backward local, as in torch, wherever it runs."""

    def body(g: ProcessGroup) -> list[torch.Tensor]:
        torch.set_num_threads(1)
        model = DistributedDataParallel(mlp(), group=g)
        x, y = batch(0, g.rank)
        with model.no_sync():
            loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        return [p.grad.clone() for p in model.parameters()]

    results = run_ranks(2, body)
    for rank, grads in enumerate(results):
        local = mlp()
        x, y = batch(0, rank)
        nn.functional.mse_loss(local(x), y).backward()
        assert_equal_lists(grads, [p.grad for p in local.parameters()], exact=False)
    assert not torch.equal(results[0][0], results[1][0])


class _FailOnce(torch.autograd.Function):
    """Identity whose backward raises while ``armed``."""

    armed = threading.Event()

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        if _FailOnce.armed.is_set() and threading.current_thread().name.endswith("-1"):
            raise RuntimeError("backward broke on rank 1")
        return grad


def test_exception_inside_backward_aborts_instead_of_hanging() -> None:
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            with INIT_LOCK:
                torch.manual_seed(0)
                self.a, self.b = nn.Linear(IN, HIDDEN), nn.Linear(HIDDEN, OUT)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(_FailOnce.apply(self.a(x)))

    def body(g: ProcessGroup) -> str:
        model = DistributedDataParallel(Model(), group=g, bucket_cap_mb=1e-6)
        try:
            for step in range(3):
                x, y = batch(step, g.rank)
                try:
                    nn.functional.mse_loss(model(x), y).backward()
                except RuntimeError as e:
                    if "backward broke" not in str(e):
                        raise
        except ShardlineError as e:
            return f"{type(e).__name__}: {e}"
        return "finished"

    _FailOnce.armed.set()
    try:
        results = run_ranks(2, body, timeout=30.0)
    finally:
        _FailOnce.armed.clear()
    assert all(r != "finished" for r in results), results
    assert "did not finish" in results[1] and "aborted" in results[1], results[1]


def test_join_forward_without_backward_is_an_error_not_a_hang() -> None:
    def body(g: ProcessGroup) -> str:
        model = DistributedDataParallel(mlp(), group=g)
        try:
            with model.join():
                for step in range(2 + g.rank):
                    x, y = batch(step, g.rank)
                    loss = nn.functional.mse_loss(model(x), y)
                    if step == 0:
                        continue  # "skip this batch" after a forward with gradients
                    loss.backward()
        except ShardlineError as e:
            return f"{type(e).__name__}: {e}"
        return "finished"

    results = run_ranks(2, body, timeout=30.0)
    assert all(r.startswith(("ShardlineError", "CommunicatorClosedError")) for r in results)
    assert any("a forward ran before the backward" in r for r in results), results


def test_channels_last_conv_in_join_and_in_place() -> None:
    """channels_last weights keep their layout (no copy) and shadow correctly in join()."""

    def make() -> nn.Module:
        with INIT_LOCK:
            torch.manual_seed(0)
            conv = nn.Conv2d(8, 16, 3)
        return conv.to(memory_format=torch.channels_last)

    def body(g: ProcessGroup) -> list[torch.Tensor]:
        torch.set_num_threads(1)
        model = DistributedDataParallel(make(), group=g, in_place_mb=0.0, symmetric=False)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with model.join():
            for step in range(1 + g.rank):
                gen = torch.Generator().manual_seed(step * 10 + g.rank)
                x = torch.randn(2, 8, 6, 6, generator=gen).to(memory_format=torch.channels_last)
                opt.zero_grad()
                model(x).square().mean().backward()
                opt.step()
        return params(model)

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # autograd warns when a grad's layout is copied
        results = run_ranks(2, body, timeout=30.0)
    assert_equal_lists(results[0], results[1], exact=True)


@pytest.mark.multiprocess
@pytest.mark.parametrize("n", [2, 3])
def test_join_matches_torch_join_in_processes(n: int) -> None:
    """Real processes, torch's default group: our join() equals torch's DDP under its Join."""
    ranks = run_processes(n, "ddp_join_vs_torch", timeout=90)
    assert all(r.rc == 0 and "OK" in r.out for r in ranks), report(ranks)
