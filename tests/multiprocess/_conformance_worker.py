"""One rank of a torch.distributed conformance test: ``python _conformance_worker.py CASE``.

Each rank initialises torch's default group on Gloo, then makes a "shardline" group of the
same ranks, and runs every check on both groups with the same inputs: Gloo's outputs are the
oracle (tests/test_torch_conformance.py). Prints ``OK`` when every check held.
"""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

import shardline  # noqa: F401  # registers the "shardline" backend
from shardline.comm.torch_backend import cpu_backend
from tests.multiprocess._worker import _leave_torch_gloo

Group = Any  # a torch ProcessGroup


def _same(a: Any, b: Any, where: str) -> None:
    """``a`` (Gloo's) and ``b`` (ours) hold equal tensors in the same structure."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), (where, type(b))
        assert a.dtype == b.dtype and a.shape == b.shape, (
            where,
            a.dtype,
            b.dtype,
            a.shape,
            b.shape,
        )
        if a.layout == torch.sparse_coo:
            assert b.layout == torch.sparse_coo and b.is_coalesced(), where
            a, b = a.coalesce(), b.coalesce()
            assert torch.equal(a.indices(), b.indices()), (where, a, b)
            assert torch.equal(a.values(), b.values()), (where, a, b)
        else:
            assert torch.equal(a, b), (where, a, b)
    elif isinstance(a, list | tuple):
        assert isinstance(b, list | tuple) and len(a) == len(b), (where, a, b)
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


def _on_both(name: str, fn: Callable[[Group], Any], groups: dict[str, Group]) -> None:
    """Runs ``fn`` on Gloo's group, then on ours, and compares what each returned."""
    gloo, ours = fn(groups["gloo"]), fn(groups["shardline"])
    _same(gloo, ours, name)


def _groups(**kwargs: Any) -> dict[str, Group]:
    """A new Gloo group and a new shardline group of every rank."""
    return {b: dist.new_group(backend=b, **kwargs) for b in ("gloo", "shardline")}


def _inputs(r: int, n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (torch.arange(n, dtype=torch.float64) * (r + 1) + 10 * r).to(dtype)


# -- cause 1: list-shaped entry points, all_gather_coalesced first ----------------------------


def shapes() -> None:
    """Every list-shaped and flat entry point: the same outputs as Gloo, element for element."""
    r, w = dist.get_rank(), dist.get_world_size()
    groups = _groups()

    def gather_coalesced(g: Group) -> Any:
        # Inputs of several shapes, an empty one among them; one output list per rank.
        ins = [_inputs(r, 3), _inputs(r, 2).view(2, 1), torch.empty(0)]
        outs = [[torch.full_like(t, -1) for t in ins] for _ in range(w)]
        dist.all_gather_coalesced(outs, ins, group=g)
        return outs

    def reduce_coalesced(g: Group) -> Any:
        ts = [_inputs(r, 4), _inputs(r, 1)]
        dist.all_reduce_coalesced(ts, op=dist.ReduceOp.MAX, group=g)
        return ts

    def gather_list(g: Group) -> Any:
        outs = [torch.empty(2, 3) for _ in range(w)]
        dist.all_gather(outs, _inputs(r, 6).view(2, 3), group=g)
        return outs

    def gather_into(g: Group) -> Any:
        out = torch.empty(w * 2, 2, dtype=torch.float64)
        dist.all_gather_into_tensor(out, _inputs(r, 4, torch.float64).view(2, 2), group=g)
        return out

    def coalesced_tensors(g: Group) -> Any:
        # torch's coalescing manager hands these to the group's *_coalesced entry points.
        outs = [torch.empty(w * 2), torch.empty(w * 3)]
        with dist._coalescing_manager(g):
            for out, n in zip(outs, (2, 3), strict=True):
                dist.all_gather_into_tensor(out, _inputs(r, n), group=g)
        pieces = [torch.empty(2), torch.empty(1)]
        with dist._coalescing_manager(g):
            for piece, n in zip(pieces, (2, 1), strict=True):
                dist.reduce_scatter_tensor(piece, _inputs(r, n * w), group=g)
        return [outs, pieces]

    def scatter_list(g: Group) -> Any:
        out = torch.empty(3)
        dist.reduce_scatter(out, [_inputs(r, 3) + q for q in range(w)], group=g)
        return out

    def scatter_tensor(g: Group) -> Any:
        out = torch.empty(2)
        dist.reduce_scatter_tensor(out, _inputs(r, 2 * w), group=g)
        return out

    def rooted(g: Group) -> Any:
        got = [torch.empty(2) for _ in range(w)] if r == w - 1 else None
        dist.gather(_inputs(r, 2), got, dst=w - 1, group=g)
        piece = torch.empty(2)
        dist.scatter(piece, [_inputs(q, 2) for q in range(w)] if r == 0 else None, src=0, group=g)
        red = _inputs(r, 3)
        dist.reduce(red, dst=1, op=dist.ReduceOp.PRODUCT, group=g)
        return [got or [], piece, red if r == 1 else []]

    def all_to_all(g: Group) -> Any:
        # (Gloo has no all_to_all of tensor lists, nor all_gather into lists of unequal sizes:
        # no oracle for those here.)
        equal = torch.empty(2 * w)
        dist.all_to_all_single(equal, _inputs(r, 2 * w), group=g)
        sends = [q + r + 1 for q in range(w)]
        recvs = [r + q + 1 for q in range(w)]
        unequal = torch.empty(sum(recvs), 2)
        dist.all_to_all_single(
            unequal, _inputs(r, 2 * sum(sends)).view(-1, 2), recvs, sends, group=g
        )
        return [equal, unequal]

    def objects(g: Group) -> Any:
        got: list[object] = [None] * w
        dist.all_gather_object(got, {"rank": r, "sq": r * r}, group=g)
        box: list[object] = [f"from {r}"]
        dist.broadcast_object_list(box, src=1, group=g)
        return [got, box]

    def batched_p2p(g: Group) -> Any:
        got = torch.empty(4)
        ops = [
            dist.P2POp(dist.isend, _inputs(r, 4), (r + 1) % w, g),
            dist.P2POp(dist.irecv, got, (r - 1) % w, g),
        ]
        for req in dist.batch_isend_irecv(ops):
            req.wait()
        return got

    def functional(g: Group) -> Any:
        # torch's functional collectives reach the group through its backend for "cpu".
        import torch.distributed._functional_collectives as fc

        summed = fc.wait_tensor(fc.all_reduce(_inputs(r, 4), "sum", g))
        gathered = fc.wait_tensor(fc.all_gather_tensor(_inputs(r, 3), 0, g))
        scattered = fc.wait_tensor(fc.reduce_scatter_tensor(_inputs(r, 2 * w), "sum", 0, g))
        return [summed, gathered, scattered]

    checks: list[Callable[[Group], Any]] = [functional] if cpu_backend.supported() else []
    for check in (
        *checks,
        gather_coalesced,
        reduce_coalesced,
        gather_list,
        gather_into,
        coalesced_tensors,
        scatter_list,
        scatter_tensor,
        rooted,
        all_to_all,
        objects,
        batched_p2p,
    ):
        _on_both(check.__name__, check, groups)
    _leave_torch_gloo()


# -- causes 2 and 3: tags, and receives from any source ----------------------------------------


def tags() -> None:
    """Messages received by tag, in another order than sent: what Gloo receives."""
    r, w = dist.get_rank(), dist.get_world_size()
    groups = _groups()

    def by_tag(g: Group) -> Any:
        got = []
        if r == 0:  # isend: Gloo completes a send only once the receiver takes it
            sent = [
                dist.isend(_inputs(1, 3), dst=w - 1, group=g, tag=1),
                dist.isend(_inputs(2, 5), dst=w - 1, group=g, tag=2),
                dist.isend(_inputs(3, 3), dst=w - 1, group=g, tag=1),
            ]
            for work in sent:
                work.wait()
        elif r == w - 1:
            two, first, second = torch.empty(5), torch.empty(3), torch.empty(3)
            dist.recv(two, src=0, group=g, tag=2)
            dist.irecv(first, src=0, group=g, tag=1).wait()
            dist.recv(second, src=0, group=g, tag=1)
            got = [two, first, second]
        return got

    def torchs_test(g: Group) -> Any:
        # torch's test_send_recv_with_tag: every rank sends tagged with its rank to each other.
        got = []
        for dst in range(w):
            if dst == r:
                for src in range(w):
                    if src != r:
                        out = torch.full((10,), -1.0)
                        dist.recv(out, src, group=g, tag=src)
                        got.append(out)
            else:
                dist.send(torch.full((10,), float(r)), dst, group=g, tag=r)
        return got

    _on_both("by_tag", by_tag, groups)
    _on_both("torchs_test", torchs_test, groups)
    _leave_torch_gloo()


def any_source() -> None:
    """Receives from any source: every message arrives once, its sender named right."""
    r, w = dist.get_rank(), dist.get_world_size()
    groups = _groups()

    def from_anyone(g: Group) -> Any:
        got = []
        if r == 0:
            for k in range(2 * (w - 1)):
                out = torch.full((4,), -1.0)
                if k % 2:
                    work = dist.irecv(out, group=g)
                    work.wait()
                    sender = dist.get_global_rank(g, work._source_rank())
                else:
                    sender = dist.recv(out, group=g)
                assert torch.equal(out[1:], torch.full((3,), float(sender))), (sender, out)
                got.append((sender, int(out[0])))
        else:
            for k in range(2):
                dist.send(torch.tensor([float(k)] + [float(r)] * 3), dst=0, group=g)
        # The order senders are taken in is the backend's; what arrives is not.
        return sorted(got)

    _on_both("from_anyone", from_anyone, groups)
    _leave_torch_gloo()


# -- cause 4: monitored_barrier ----------------------------------------------------------------


def _error(fn: Callable[[], object], kind: type[Exception] = Exception) -> str:
    """The message of the ``kind`` error ``fn`` raises ("" if none)."""
    try:
        fn()
    except kind as exc:
        return str(exc)
    return ""


def monitored() -> None:
    """monitored_barrier passes when all arrive, and names the ranks that do not, as Gloo."""
    r = dist.get_rank()
    wait = timedelta(seconds=2)

    def passes(g: Group) -> Any:
        dist.monitored_barrier(g, timeout=wait)
        dist.monitored_barrier(g, timeout=wait, wait_all_ranks=True)
        return "passed"

    def one_missing(g: Group) -> Any:
        if r == 1:
            return ""  # rank 1 never arrives
        text = _error(lambda: dist.monitored_barrier(g, timeout=wait), RuntimeError)
        if r == 0:
            return re.findall(r"Rank \d+ failed to pass monitoredBarrier in \d+ ms", text)
        return f"Rank {r} successfully reached monitoredBarrier, but received errors" in text

    def all_missing(g: Group) -> Any:
        if r != 0:
            return ""
        text = _error(
            lambda: dist.monitored_barrier(g, timeout=0.5, wait_all_ranks=True), RuntimeError
        )
        return re.findall(r"Ranks [\d, ]+ failed to pass monitoredBarrier", text)

    def no_time(g: Group) -> Any:
        if r != 0:
            return ""
        text = _error(lambda: g.monitored_barrier(timedelta(seconds=0)), RuntimeError)
        return "Rank 0 timed out in monitoredBarrier after 0 ms" in text

    _on_both("passes", passes, _groups())
    for check in (one_missing, all_missing, no_time):
        # A failed barrier leaves Gloo's group out of step: new groups for each check. Gloo's
        # ranks other than 0 wait for rank 0 up to the group's timeout.
        _on_both(check.__name__, check, _groups(timeout=timedelta(seconds=5)))
        _store_barrier(check.__name__)
    _leave_torch_gloo()


def _store_barrier(name: str) -> None:
    """Waits, through the default store, until every rank got here."""
    store = dist.distributed_c10d._get_default_store()
    store.add(f"barrier/{name}", 1)
    while int(store.add(f"barrier/{name}", 0)) < dist.get_world_size():
        time.sleep(0.01)


# -- cause 5: a barrier that times out says so in the words torch's tools look for ---------------


def barrier_timeout() -> None:
    """A barrier only rank 0 enters fails on rank 0 within its group's timeout, saying so."""
    r = dist.get_rank()
    groups = _groups(timeout=timedelta(seconds=1))
    for name, g in groups.items():
        if r != 0:
            continue
        start = time.monotonic()
        text = _error(lambda g=g: dist.barrier(g)) or "no error"
        took = time.monotonic() - start
        assert re.search(" (Timed out|closed|timeout) ", text), (name, text)
        assert 0.9 < took < 10, (name, took)
        print(f"TIMEOUT {name} {took:.2f}s {text.splitlines()[0]}", flush=True)
    _store_barrier("timeouts")  # the others leave once rank 0 saw both time out
    _leave_torch_gloo()


# -- cause 6: sparse all_reduce ----------------------------------------------------------------


def sparse() -> None:
    """Sparse COO all_reduce: Gloo's sum, indices and values, coalesced."""
    r, w = dist.get_rank(), dist.get_world_size()
    groups = _groups()

    def reduce(g: Group) -> Any:
        # Duplicate indices (uncoalesced), a dense dimension, a rank with no entries, ints.
        i = torch.tensor([[0, 2, 0, r], [1, 1, 1, 0]])
        v = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]]) * (r + 1)
        a = torch.sparse_coo_tensor(i, v, (w + 2, 3, 2))
        b = torch.sparse_coo_tensor(torch.tensor([[r]]), torch.tensor([r + 1.0]), (w,))
        if r == 0:
            empty = torch.sparse_coo_tensor(torch.empty(1, 0), torch.empty(0), (w,))
        else:
            empty = torch.sparse_coo_tensor(torch.tensor([[r]]), torch.tensor([r]), (w,))
        empty = empty.to(torch.int64)
        for t in (a, b, empty):
            dist.all_reduce(t, group=g)
        return [a, b, empty]

    _on_both("reduce", reduce, groups)
    _leave_torch_gloo()


CASES = {
    "shapes": shapes,
    "tags": tags,
    "any_source": any_source,
    "monitored": monitored,
    "barrier_timeout": barrier_timeout,
    "sparse": sparse,
}

if __name__ == "__main__":
    dist.init_process_group("gloo")
    CASES[sys.argv[1]]()
