"""One rank of a multiprocess test: ``python _worker.py SCENARIO``, configured by env vars.

Prints ``OK ...`` lines the parent checks, or ``ERROR <Class> <elapsed> <message>`` when the
scenario expects a failure. Exit status 0 means the rank behaved as the scenario requires.
"""

from __future__ import annotations

import copy
import math
import os
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import shardline as sl

BACKEND = os.environ.get("WORKER_BACKEND") or None  # the harness's own test uses gloo


def allreduce() -> None:
    sl.init(backend=BACKEND)
    r, w = sl.get_rank(), sl.get_world_size()
    for n in (0, 1, 1000, (1 << 20) + 7):
        t = torch.full((n,), float(r + 1))
        sl.all_reduce(t)
        assert torch.equal(t, torch.full((n,), float(w * (w + 1) // 2))), (n, t[:4])
    out = torch.empty(3 * w, dtype=torch.int64)
    sl.all_gather(out, torch.arange(3) + 10 * r)
    assert out.tolist() == [k + 10 * q for q in range(w) for k in range(3)]
    sl.barrier()
    print("OK", flush=True)
    sl.shutdown()


def kill_loop() -> None:
    sl.init(backend=BACKEND)
    t = torch.ones(4 << 20)  # 16 MiB
    last = time.monotonic()
    print("LOOPING", flush=True)
    try:
        while True:
            sl.all_reduce(t, op="max")
            last = time.monotonic()
    except sl.PeerLostError as exc:
        print(f"ERROR PeerLostError {time.monotonic() - last:.3f} {exc}", flush=True)
    sl.shutdown()


def mismatch() -> None:
    sl.init(backend=BACKEND)
    start = time.monotonic()
    try:
        if sl.get_rank() == 0:
            sl.all_reduce(torch.ones(1024))
        else:
            sl.all_gather(torch.empty(1024 * sl.get_world_size()), torch.ones(1024))
    except sl.CollectiveMismatchError as exc:
        print(f"ERROR CollectiveMismatchError {time.monotonic() - start:.3f} {exc}", flush=True)
    sl.shutdown()


def expect_failure() -> None:
    """Any ShardlineError at init or in the first op is fine; hanging is not."""
    start = time.monotonic()
    try:
        sl.init(backend=BACKEND)
        sl.all_reduce(torch.ones(16))
        print("OK no error", flush=True)
    except sl.ShardlineError as exc:
        print(f"ERROR {type(exc).__name__} {time.monotonic() - start:.3f} {exc}", flush=True)
    finally:
        sl.shutdown()


def slow_start() -> None:
    """Rank 0 stops between publishing its address and dialling rank 1 until the file
    ``WORKER_GO`` exists (at most 120 s). Meanwhile rank 1's listener is accepting and waiting
    for rank 0, open to the test's garbage writer."""
    if os.environ["RANK"] == "0":
        from shardline.comm.backends import native

        exchange = native.exchange

        def held(*args: Any) -> list[str]:
            values = exchange(*args)
            if args[-1] == "address":
                go, deadline = os.environ["WORKER_GO"], time.monotonic() + 120
                while not os.path.exists(go) and time.monotonic() < deadline:
                    time.sleep(0.05)
            return values

        native.exchange = held  # type: ignore[assignment]
    allreduce()


# -- torch.distributed backend "shardline" (tests/test_torch_backend.py) ------------------------


def _torch_init(how: str = "env") -> tuple[int, int]:
    """``init_process_group("shardline")`` from env://, or with an explicit ``store=``."""
    if how == "store":
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        store = dist.TCPStore(  # type: ignore[attr-defined]
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            world,
            rank == 0,
            timedelta(seconds=30),
        )
        dist.init_process_group("shardline", store=store, rank=rank, world_size=world)
    else:
        dist.init_process_group("shardline")
    return dist.get_rank(), dist.get_world_size()


def torch_collectives() -> None:
    """Every torch.distributed collective on backend "shardline" against expected values."""
    r, w = _torch_init(os.environ.get("WORKER_INIT", "env"))
    assert dist.get_backend() == "shardline", dist.get_backend()
    total = w * (w + 1) / 2  # sum of rank + 1

    for op, want in [
        (dist.ReduceOp.SUM, total),
        (dist.ReduceOp.AVG, total / w),
        (dist.ReduceOp.MAX, float(w)),
        (dist.ReduceOp.MIN, 1.0),
        (dist.ReduceOp.PRODUCT, float(math.factorial(w))),
    ]:
        t = torch.full((1000,), float(r + 1))
        dist.all_reduce(t, op=op)
        assert torch.equal(t, torch.full((1000,), want)), (op, t[:4])
    big = torch.full(((1 << 20) + 3,), float(r + 1), dtype=torch.float64)
    dist.all_reduce(big)
    assert torch.equal(big, torch.full_like(big, total))

    outs = [torch.empty(3, dtype=torch.int64) for _ in range(w)]
    dist.all_gather(outs, torch.arange(3) + 10 * r)
    assert [o.tolist() for o in outs] == [[10 * q, 10 * q + 1, 10 * q + 2] for q in range(w)]
    flat = torch.empty(w, 3, dtype=torch.int64)
    dist.all_gather_into_tensor(flat, torch.arange(3) + 10 * r)
    assert flat.tolist() == [[10 * q, 10 * q + 1, 10 * q + 2] for q in range(w)]

    inp = torch.arange(2 * w, dtype=torch.float32) * (r + 1)
    out = torch.empty(2)
    dist.reduce_scatter_tensor(out, inp)
    assert out.tolist() == [float(k) * total for k in (2 * r, 2 * r + 1)], out
    out = torch.empty(2)
    dist.reduce_scatter(out, list(inp.chunk(w)), op=dist.ReduceOp.MAX)
    assert out.tolist() == [float(k) * w for k in (2 * r, 2 * r + 1)], out

    b = torch.full((4,), float(r))
    dist.broadcast(b, src=w - 1)
    assert torch.equal(b, torch.full((4,), float(w - 1)))
    red = torch.full((4,), float(r + 1))
    dist.reduce(red, dst=0)
    if r == 0:
        assert torch.equal(red, torch.full((4,), total))

    gl = [torch.empty(2) for _ in range(w)] if r == 0 else None
    dist.gather(torch.full((2,), float(r)), gl, dst=0)
    if r == 0:
        assert gl is not None and [g.tolist() for g in gl] == [[float(q)] * 2 for q in range(w)]
    sc = torch.empty(2)
    dist.scatter(sc, [torch.full((2,), 10.0 + q) for q in range(w)] if r == 1 else None, src=1)
    assert sc.tolist() == [10.0 + r] * 2

    a2a_out = torch.empty(2 * w)
    dist.all_to_all_single(a2a_out, torch.arange(2 * w, dtype=torch.float32) + 100 * r)
    assert a2a_out.tolist() == [100.0 * q + 2 * r + k for q in range(w) for k in range(2)]
    # Unequal splits: rank r sends q + r + 1 rows of 3 to rank q.
    in_splits = [q + r + 1 for q in range(w)]
    out_splits = [r + q + 1 for q in range(w)]
    src = torch.arange(sum(in_splits) * 3, dtype=torch.int64).view(-1, 3) + 1000 * r
    dst = torch.full((sum(out_splits), 3), -1, dtype=torch.int64)
    dist.all_to_all_single(dst, src, out_splits, in_splits)
    want_rows = []
    for q in range(w):
        start = sum(r2 + q + 1 for r2 in range(r))  # rows q sends before those for r
        rows = torch.arange(start * 3, (start + r + q + 1) * 3).view(-1, 3) + 1000 * q
        want_rows.append(rows)
    assert torch.equal(dst, torch.cat(want_rows)), dst
    lists_out = [torch.empty(q + 1) for q in range(w)]
    dist.all_to_all(lists_out, [torch.full((r + 1,), float(10 * r + q)) for q in range(w)])
    assert [o.tolist() for o in lists_out] == [[float(10 * q + r)] * (q + 1) for q in range(w)]

    dist.barrier()
    if r == 0:
        dist.send(torch.arange(5.0), dst=1)
        back = torch.empty(5)
        dist.recv(back, src=1)
        assert back.tolist() == [2.0 * k for k in range(5)]
    elif r == 1:
        got = torch.empty(5)
        dist.recv(got, src=0)
        dist.send(got * 2, dst=0)

    # batch_isend_irecv (torch sends the ops one at a time: no coalescing here), both ranks
    # posting isend first; and the pickled-object collectives built on broadcast/all_gather.
    peer = (r + 1) % w
    got = torch.empty(4)
    ops = [
        dist.P2POp(dist.isend, torch.arange(4.0) + 10 * r, peer),
        dist.P2POp(dist.irecv, got, (r - 1) % w),
    ]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    assert got.tolist() == [10.0 * ((r - 1) % w) + k for k in range(4)], got
    objs: list[object] = [None] * w
    dist.all_gather_object(objs, {"rank": r})
    assert objs == [{"rank": q} for q in range(w)], objs
    box: list[object] = [f"from {r}"]
    dist.broadcast_object_list(box, src=w - 1)
    assert box == [f"from {w - 1}"], box

    # async_op=True: the call returns at once, wait() and get_future() both work.
    store = dist.distributed_c10d._get_default_store()
    if r != 0:
        store.wait(["torch_collectives/go"])  # join once rank 0 saw its op still pending
    t = torch.full((8,), float(r + 1))
    work = dist.all_reduce(t, async_op=True)
    fut = work.get_future()
    if r == 0:
        time.sleep(0.2)
        assert not work.is_completed() and not fut.done()
        store.set("torch_collectives/go", "1")
    done = threading.Event()
    fut.then(lambda _f: done.set())
    assert done.wait(20), "future did not complete without wait()"
    assert work.is_completed() and torch.equal(t, torch.full((8,), total))
    assert torch.equal(fut.value()[0], t)
    assert work.wait() is True
    works = [dist.broadcast(torch.full((3,), float(r)), src=0, async_op=True) for _ in range(4)]
    works.append(dist.barrier(async_op=True))
    for wk in works:
        wk.wait()

    # A sub-group with group-local ranks.
    sub = dist.new_group([w - 1], backend="shardline")
    if r == w - 1:
        x = torch.ones(3)
        dist.all_reduce(x, group=sub)
        assert torch.equal(x, torch.ones(3))
    pair = dist.new_group(list(range(w)), backend="shardline")
    y = torch.full((2,), float(r))
    dist.all_reduce(y, op=dist.ReduceOp.MAX, group=pair)
    assert torch.equal(y, torch.full((2,), float(w - 1)))

    dist.barrier()
    dist.destroy_process_group()
    print("OK", flush=True)


def _expect(kind: type[Exception], words: tuple[str, ...], fn: Callable[[], object]) -> str:
    """Runs ``fn``, which must raise ``kind`` with every one of ``words`` in its message."""
    try:
        fn()
    except kind as exc:
        text = str(exc)
    else:
        raise AssertionError(f"expected {kind.__name__}, nothing was raised")
    missing = [word for word in words if word.lower() not in text.lower()]
    if missing:
        raise AssertionError(f"{kind.__name__} message lacks {missing}: {text}")
    return text


def torch_errors() -> None:
    """Clear errors: unsupported ops, bad tags, CUDA tensors; a mismatch raises on both ranks."""
    r, _ = _torch_init()
    bad = sl.InvalidArgumentError
    for op in (dist.ReduceOp.BAND, dist.ReduceOp.BOR, dist.ReduceOp.BXOR):
        ints = torch.ones(2, dtype=torch.int32)
        _expect(bad, ("does not support ReduceOp",), lambda op=op, t=ints: dist.all_reduce(t, op))
    if torch.cuda.is_available():
        cuda = torch.ones(2, device="cuda")
        _expect(bad, ("CPU tensors", "nccl"), lambda: dist.all_reduce(cuda))
        print("CUDA-CHECKED", flush=True)
    _expect(bad, ("tag=-1",), lambda: dist.send(torch.ones(2), dst=1 - r, tag=-1))
    dist.all_reduce(torch.ones(2))  # the group still works after refused calls
    # Ranks disagree: both raise CollectiveMismatchError instead of hanging.
    work = dist.all_reduce(torch.ones(4 if r == 0 else 8), async_op=True)
    text = _expect(sl.CollectiveMismatchError, ("all_reduce",), work.wait)
    print(f"ERROR CollectiveMismatchError {text}", flush=True)
    dist.destroy_process_group()
    print("OK", flush=True)


def torch_ddp() -> None:
    """torch's DDP on "shardline" and on "gloo" (same processes): same grads, same params."""
    r, w = _torch_init()
    gloo = dist.new_group(backend="gloo")
    # find_unused_parameters adds an async all_reduce of the used-parameter map that the C++
    # reducer waits on through Work.wait(); gradient_as_bucket_view reduces in place.
    configs: list[dict[str, Any]] = [
        {},
        {"find_unused_parameters": True, "gradient_as_bucket_view": True},
    ]
    for config in configs:
        torch.manual_seed(0)
        layers = [torch.nn.Linear(16, 32)] + [torch.nn.Linear(32, 32) for _ in range(3)]
        base = torch.nn.Sequential(*layers, torch.nn.Linear(32, 4))
        models = {name: copy.deepcopy(base) for name in ("shardline", "gloo")}
        # 2 KB buckets: one per 4 KiB weight once DDP rebuilds its buckets after step 0.
        ddps = {
            "shardline": DistributedDataParallel(
                models["shardline"], bucket_cap_mb=0.002, **config
            ),
            "gloo": DistributedDataParallel(
                models["gloo"], process_group=gloo, bucket_cap_mb=0.002, **config
            ),
        }
        opts = {k: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for k, m in ddps.items()}
        gen = torch.Generator().manual_seed(100 + r)  # different data on every rank
        for step in range(4):
            x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)
            grads = {}
            for name, ddp in ddps.items():
                opts[name].zero_grad()
                torch.nn.functional.mse_loss(ddp(x), y).backward()  # type: ignore[no-untyped-call]
                grads[name] = [p.grad.clone() for p in ddp.parameters()]  # type: ignore[union-attr]
                opts[name].step()
            for a, b in zip(grads["shardline"], grads["gloo"], strict=True):
                assert torch.equal(a, b), (config, step, (a - b).abs().max())
        pairs = zip(models["shardline"].parameters(), models["gloo"].parameters(), strict=True)
        assert all(torch.equal(a, b) for a, b in pairs), config
        # Every rank holds the same parameters although each saw different data.
        flat = torch.cat([p.detach().reshape(-1) for p in models["shardline"].parameters()])
        everyone = [torch.empty_like(flat) for _ in range(w)]
        dist.all_gather(everyone, flat)
        assert all(torch.equal(e, flat) for e in everyone), config
        data = ddps["shardline"]._get_ddp_logging_data()  # type: ignore[no-untyped-call]
        rebuilt = data.get("rebuilt_bucket_sizes", "")
        print(f"BUCKETS {len(str(rebuilt).split(','))} {config}", flush=True)
    _leave_torch_gloo()


def ddp_join_vs_torch() -> None:
    """Our DDP's join() against torch's DDP under torch's Join, in the same processes."""
    from torch.distributed.algorithms.join import Join

    from shardline.comm import init_process_group

    dist.init_process_group("gloo")  # torch's Join needs a default group
    r, w = dist.get_rank(), dist.get_world_size()
    store = dist.PrefixStore("shardline-ddp", dist.distributed_c10d._get_default_store())
    group = init_process_group(store, r, w, master_addr=os.environ["MASTER_ADDR"])
    counts = [2, 5, 3][:w]
    torch.manual_seed(0)
    base = torch.nn.Sequential(
        torch.nn.Linear(12, 24), torch.nn.BatchNorm1d(24), torch.nn.Tanh(), torch.nn.Linear(24, 5)
    )
    ours = sl.DistributedDataParallel(copy.deepcopy(base), group=group, bucket_cap_mb=0.001)
    theirs = DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=0.001)
    for model in (ours, theirs):
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        ctx = ours.join() if model is ours else Join([theirs])
        with ctx:
            for step in range(counts[r]):
                gen = torch.Generator().manual_seed(100 * step + r)
                x, y = torch.randn(8, 12, generator=gen), torch.randn(8, 5, generator=gen)
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
    mine, torchs = ours.state_dict(), theirs.module.state_dict()
    for key in torchs:
        if w == 2:  # a sum of two numbers: bit for bit
            assert torch.equal(mine[key], torchs[key]), (key, (mine[key] - torchs[key]).abs())
        else:  # 1/3 scaling and summation order differ in the last bits
            torch.testing.assert_close(mine[key], torchs[key], rtol=1e-5, atol=1e-6)
    group.shutdown()
    _leave_torch_gloo()


def _leave_torch_gloo() -> None:
    """Ends a scenario that ran a torch gloo group: "OK", then exit at once.

    gloo's worker threads drop each finished work a moment after completing it, and dropping
    its tensors needs the GIL. If the interpreter is already exiting then, Python ends that
    thread inside a C++ destructor: ``terminate called without an active exception`` (SIGABRT,
    a few percent of runs, after every check passed; a barrier does not help, as the drop
    follows the completion). So, once torch's group is destroyed and "OK" printed, the process
    leaves without interpreter teardown. Our own group was shut down before, explicitly.
    """
    dist.barrier()
    dist.destroy_process_group()
    print("OK", flush=True)
    sys.stderr.flush()
    os._exit(0)


def zero_vs_torch() -> None:
    """Our zero1 against torch DDP + ZeroRedundancyOptimizer, our zero3 against FSDP2."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from shardline.comm import init_process_group

    dist.init_process_group("gloo")
    r, w = dist.get_rank(), dist.get_world_size()
    store = dist.PrefixStore("shardline-zero", dist.distributed_c10d._get_default_store())
    group = init_process_group(store, r, w, master_addr=os.environ["MASTER_ADDR"])
    torch.manual_seed(0)
    base = torch.nn.Sequential(
        torch.nn.Linear(12, 32), torch.nn.LayerNorm(32), torch.nn.Tanh(), torch.nn.Linear(32, 5)
    )

    def run(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[float]:
        losses = []
        for step in range(8):
            gen = torch.Generator().manual_seed(100 * step + r)
            x, y = torch.randn(8, 12, generator=gen), torch.randn(8, 5, generator=gen)
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            losses.append(float(loss))
        return losses

    # zero1 vs DDP + ZeroRedundancyOptimizer
    theirs = DistributedDataParallel(copy.deepcopy(base))
    zro = ZeroRedundancyOptimizer(theirs.parameters(), torch.optim.AdamW, lr=1e-2)
    plain = copy.deepcopy(base)
    ours, opt = sl.distribute(
        plain, torch.optim.AdamW(plain.parameters(), lr=1e-2), strategy="zero1", group=group
    )
    assert opt is not None
    a, b = run(ours, opt), run(theirs, zro)
    assert a == b or max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-5, (a, b)
    mine, torchs = ours.state_dict(), theirs.module.state_dict()
    for key in torchs:
        torch.testing.assert_close(mine[key], torchs[key], rtol=1e-5, atol=1e-6)

    # zero3 vs FSDP2 (fully_shard on each Linear, then the root)
    fsdp = copy.deepcopy(base)
    for layer in (fsdp[0], fsdp[3]):
        fully_shard(layer)
    fully_shard(fsdp)
    plain = copy.deepcopy(base)
    ours, opt = sl.distribute(
        plain,
        torch.optim.AdamW(plain.parameters(), lr=1e-2),
        strategy="zero3",
        group=group,
        unit_mb=0.001,
    )
    assert opt is not None
    a = run(ours, opt)
    b = run(fsdp, torch.optim.AdamW(fsdp.parameters(), lr=1e-2))
    assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-5, (a, b)
    mine = ours.state_dict()
    for key, value in fsdp.state_dict().items():
        full = value.full_tensor() if hasattr(value, "full_tensor") else value
        torch.testing.assert_close(mine[key], full, rtol=1e-5, atol=1e-6)
    group.shutdown()
    _leave_torch_gloo()


SCENARIOS = {
    "allreduce": allreduce,
    "kill_loop": kill_loop,
    "mismatch": mismatch,
    "expect_failure": expect_failure,
    "slow_start": slow_start,
    "torch_collectives": torch_collectives,
    "torch_errors": torch_errors,
    "torch_ddp": torch_ddp,
    "ddp_join_vs_torch": ddp_join_vs_torch,
    "zero_vs_torch": zero_vs_torch,
}

if __name__ == "__main__":
    SCENARIOS[sys.argv[1]]()
