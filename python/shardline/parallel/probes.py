"""Short probes on the rank that will train: what ``timing.predict`` models a step from.

``probe_step`` measures:

- compute: one rank's batch through the model's forward and backward, under each recompute
  policy and compute dtype that a fitting choice uses (``recomputing``; for a
  mixed-precision compute dtype the parameters and floating inputs cast to it, as ZeRO
  gathers them), the fastest of 3 to 20 runs (about half a second of them, after one to
  warm up; one run when it takes 5 s), and the host's time to issue it. Each gradient is
  dropped as soon as it is made. The model is left as it was: its gradients, buffers (a
  norm's running statistics) and the RNG state are restored.
  Where pipelines split the batch into micro-batches smaller than it (``narrow``, on CPU),
  the same passes of the smallest micro-batch's rows too: what a pass costs whatever its
  rows (Python, dispatch, small kernels) is then the line's intercept (``Compute.fixed``).
- the optimizer: one step over a flat tensor, per element updated.
- the link: all-reduces of a small and a large message on the group (latency, bandwidth),
  and the host's time to start one.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from shardline.parallel.activations import _map_tensors
from shardline.parallel.recompute.blocks import recomputing
from shardline.parallel.timing import Compute, Link, Probes

if TYPE_CHECKING:
    from shardline.comm.group import ProcessGroup

__all__ = [
    "call_args",
    "kept_rng",
    "loss_of",
    "optimizer_class",
    "probe_step",
    "sync",
]

_SMALL, _LARGE = 4096, 16 * 2**20  # the link probe's message sizes, bytes
_LATENCY_SHARE = 0.75  # of the large message's time, at most, is latency (``_probe_link``)
_OVERLAP = {"cuda": 1.0, "cpu": 0.5}  # fraction of a phase's compute its communication hides behind
_LONG = 5.0  # s: a probe run this long is measured once
_RUNS, _ENOUGH = 20, 0.5  # at most this many runs, fewer once they took this many seconds


def probe_step(
    model: nn.Module,
    example_input: Any,
    *,
    group: ProcessGroup | None = None,
    optimizer: str | torch.optim.Optimizer | None = "adamw",
    computes: Iterable[tuple[str | None, torch.dtype | None]] = ((None, None),),
    elements: int | None = None,
    narrow: float | None = None,
) -> Probes:
    """Times this rank's compute, optimizer and link (see the module docstring).

    Args:
        model: The plain model, on its device; left as it was.
        example_input: One rank's batch (a tensor, a tuple of arguments or a dict of keyword
            arguments). Backward runs from the output: its ``loss`` when it has one, else the
            sum of its first floating tensor.
        group: The group whose link is probed (every rank of it must call this); ``None``
            probes no link.
        optimizer: The optimizer name or instance whose step is timed (AdamW for a name it
            does not know).
        computes: The ``(recompute policy, compute dtype)`` pairs to time.
        elements: Elements the optimizer probe steps (up to 4 Mi; the model's size when
            ``None``).
        narrow: The smallest micro-batch a choice runs, as a fraction of ``example_input``'s
            rows (its tensors' first dimension): on CPU each compute probe without a recompute
            policy (what pipelines are priced from) also times that many rows (at most half
            of them) and fits ``Compute.fixed``. On CUDA the host's
            time per micro-batch is priced from ``Compute.host`` instead.
    """
    started = time.perf_counter()
    device = next(model.parameters()).device
    compute = {}
    notes = []
    narrow = narrow if device.type != "cuda" else None
    for key in dict.fromkeys(computes):
        try:
            # pipelines are priced from the probe without a recompute policy: only it narrows
            few = narrow if key[0] is None else None
            compute[key] = _probe_compute(model, example_input, *key, narrow=few)
        except (torch.OutOfMemoryError, RuntimeError) as e:  # left untimed, and said why
            if device.type == "cuda":
                torch.cuda.empty_cache()
            what = f"recompute={key[0]}" + (f" in {key[1]}" if key[1] is not None else "")
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            notes.append(f"the compute probe ({what}) failed: {first}")
    n = elements if elements is not None else sum(p.numel() for p in model.parameters())
    per_element = _probe_optimizer(optimizer, device, max(1, min(n, 4 * 2**20)))
    link = _probe_link(group, device) if group is not None and group.world_size > 1 else None
    overlap = _OVERLAP.get(device.type, 0.5)
    seconds = time.perf_counter() - started
    return Probes(compute, per_element, link, overlap, seconds, tuple(notes), device.type == "cuda")


def sync(device: torch.device) -> None:
    """Waits for ``device``'s queued work (CUDA); the CPU has none."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def kept_rng(device: torch.device) -> contextlib.AbstractContextManager[None]:
    """The RNG state (the CPU's and ``device``'s) as it was, after the block."""
    devices = [device] if device.type == "cuda" else []
    return torch.random.fork_rng(devices=devices, device_type=device.type)


@contextlib.contextmanager
def _untouched(model: nn.Module, device: torch.device) -> Iterator[None]:
    """The model's gradients, buffers and the RNG state as they were, after the block.

    Within it each gradient is dropped as soon as backward has made it, so the probe holds
    no more than one at a time.
    """
    grads = [(p, p.grad) for p in model.parameters()]
    for p, _ in grads:
        p.grad = None
    dropping = [
        p.register_post_accumulate_grad_hook(_drop_grad)  # type: ignore[no-untyped-call]
        for p in model.parameters()
        if p.requires_grad
    ]
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    with kept_rng(device):
        try:
            yield
        finally:
            for h in dropping:
                h.remove()
            for p, g in grads:
                p.grad = g
            with torch.no_grad():
                for b, kept in buffers:
                    b.copy_(kept)


def _drop_grad(p: torch.Tensor) -> None:
    p.grad = None


def loss_of(out: Any) -> torch.Tensor:
    """A scalar to run backward from: the output's loss, else its first floating tensor summed."""
    loss = getattr(out, "loss", None) if not isinstance(out, torch.Tensor) else None
    if isinstance(loss, torch.Tensor):
        return loss
    found: list[torch.Tensor] = []

    def first(t: torch.Tensor) -> torch.Tensor:
        if not found and t.is_floating_point() and t.requires_grad:
            found.append(t)
        return t

    _map_tensors(out if not hasattr(out, "to_tuple") else out.to_tuple(), first)
    if not found:
        raise ValueError("the model's output holds no tensor that requires grad")
    return found[0].float().sum()


def call_args(example_input: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` to call a model with: a tensor, a tuple of arguments or a dict."""
    if isinstance(example_input, Mapping):
        return (), dict(example_input)
    return (example_input if isinstance(example_input, tuple) else (example_input,)), {}


@contextlib.contextmanager
def _low_precision(
    model: nn.Module, args: Any, kwargs: Any, dtype: torch.dtype | None
) -> Iterator[tuple[Any, Any]]:
    """Within it the floating parameters hold ``dtype`` copies, as ZeRO gathers them.

    Yields the arguments with their floating tensors cast too.
    """
    if dtype is None:
        yield args, kwargs
        return

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if t.is_floating_point() else t

    kept = [(p, p.data) for p in model.parameters() if p.is_floating_point()]
    for p, data in kept:
        p.data = data.to(dtype)
    try:
        yield _map_tensors(args, cast), _map_tensors(kwargs, cast)
    finally:
        for p, data in kept:
            p.data = data


def _probe_compute(
    model: nn.Module,
    example_input: Any,
    policy: str | None,
    dtype: torch.dtype | None,
    *,
    narrow: float | None = None,
) -> Compute:
    """The fastest of a few forward and backward passes of ``example_input``.

    Under a compute ``dtype`` the parameters and floating inputs are cast to it first, as the
    sharded strategies' mixed precision does. With ``narrow`` (a fraction of the rows), the
    same of that many rows (at most half) too, and ``fixed`` from the two.
    """
    device = next(model.parameters()).device
    with (
        _untouched(model, device),
        _low_precision(model, *call_args(example_input), dtype) as (args, kwargs),
        recomputing(model, policy),
    ):
        best = _fastest(model, args, kwargs, device)
        rows = _rows((args, kwargs))
        if narrow is None or rows < 2:
            return best
        few = max(1, min(rows // 2, int(rows * narrow)))
        cut_args, cut_kwargs = _first_rows((args, kwargs), rows, few)
        try:
            small = _fastest(model, cut_args, cut_kwargs, device)
        except RuntimeError:  # a model that cannot take fewer rows: no fixed part priced
            return best
    whole, part = best.forward + best.backward, small.forward + small.backward
    per_row = max(0.0, whole - part) / (rows - few)
    return replace(best, fixed=min(part, max(0.0, whole - per_row * rows)))


def _fastest(
    model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], device: torch.device
) -> Compute:
    """The fastest forward, backward and issuing of a few passes (module docstring)."""
    best = Compute(math.inf, math.inf, math.inf)
    spent = 0.0
    for run in range(_RUNS):
        sync(device)
        t0 = time.perf_counter()
        loss = loss_of(model(*args, **kwargs))
        issued = time.perf_counter() - t0
        sync(device)
        t1 = time.perf_counter()
        loss.backward()  # type: ignore[no-untyped-call]
        issued += time.perf_counter() - t1
        sync(device)
        t2 = time.perf_counter()
        del loss
        if run == 0 and t2 - t0 < _LONG:
            continue  # a warm-up: allocator, kernels chosen, caches
        best = Compute(
            min(best.forward, t1 - t0), min(best.backward, t2 - t1), min(best.host, issued)
        )
        spent += t2 - t0
        if t2 - t0 >= _LONG or (run >= 3 and spent >= _ENOUGH):
            break
    return best


def _rows(inputs: Any) -> int:
    """The first dimension of the first tensor of ``inputs`` with one (0 where none has)."""
    found: list[int] = []

    def see(t: torch.Tensor) -> torch.Tensor:
        if not found and t.dim():
            found.append(t.shape[0])
        return t

    _map_tensors(inputs, see)
    return found[0] if found else 0


def _first_rows(inputs: Any, rows: int, few: int) -> Any:
    """``inputs`` with every tensor of ``rows`` rows cut to its first ``few``."""
    return _map_tensors(inputs, lambda t: t[:few] if t.dim() and t.shape[0] == rows else t)


_OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "adamw": (torch.optim.AdamW, {}),
    "adam": (torch.optim.Adam, {}),
    "sgd": (torch.optim.SGD, {"lr": 0.01}),
    "sgd-momentum": (torch.optim.SGD, {"lr": 0.01, "momentum": 0.9}),
    "adagrad": (torch.optim.Adagrad, {}),
    "rmsprop": (torch.optim.RMSprop, {}),
}


def optimizer_class(
    optimizer: str | torch.optim.Optimizer | None,
) -> tuple[type[torch.optim.Optimizer] | None, dict[str, Any]]:
    """The class and hyperparameters of a stand-in for ``optimizer``.

    AdamW for a name it does not know; ``(None, {})`` for none.
    """
    if optimizer is None or optimizer == "none":
        return None, {}
    if isinstance(optimizer, torch.optim.Optimizer):
        hp = {k: v for k, v in optimizer.defaults.items() if not isinstance(v, torch.Tensor)}
        hp.pop("differentiable", None)
        return type(optimizer), hp
    return _OPTIMIZERS.get(optimizer.lower(), _OPTIMIZERS["adamw"])


def _probe_optimizer(
    optimizer: str | torch.optim.Optimizer | None, device: torch.device, n: int
) -> float:
    """Seconds per element of one step of ``optimizer`` over ``n`` float32 elements."""
    cls, hp = optimizer_class(optimizer)
    if cls is None:
        return 0.0
    flat = torch.zeros(n, device=device, requires_grad=True)
    flat.grad = torch.full_like(flat, 1e-3)
    try:
        opt = cls([flat], **hp)
    except (TypeError, ValueError):  # hyperparameters tied to the instance's own tensors
        opt = torch.optim.AdamW([flat])
    best = math.inf
    for _ in range(4):
        sync(device)
        t0 = time.perf_counter()
        opt.step()
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return best / n


def _probe_link(group: ProcessGroup, device: torch.device) -> Link:
    """The group's all-reduce: latency, bandwidth and the host time to start one.

    Latency and bandwidth come from a small and a large message, each the fastest of four,
    the two sizes taking turns after one of each to warm up. At most ``_LATENCY_SHARE`` of
    the large message's time is taken for latency, so that a slow small message cannot make
    the bandwidth unbounded: on two H200s, where one run's probe read 46 µs and 287 GB/s,
    another's (the small message first, four times, then the large) read 117 µs and 322 TB/s.
    """
    tensors = {n: torch.zeros(n // 4, device=device) for n in (_SMALL, _LARGE)}
    for t in tensors.values():
        group.all_reduce(t)
    times = dict.fromkeys(tensors, math.inf)
    for _ in range(4):
        for nbytes, t in tensors.items():
            sync(device)
            t0 = time.perf_counter()
            group.all_reduce(t)
            sync(device)
            times[nbytes] = min(times[nbytes], time.perf_counter() - t0)
    small = [torch.zeros(_SMALL // 4, device=device) for _ in range(8)]
    sync(device)
    t0 = time.perf_counter()
    works = [group.all_reduce(t, async_op=True) for t in small]
    issue = (time.perf_counter() - t0) / len(small)
    for w in works:
        assert w is not None
        w.wait()
    sync(device)
    world = group.world_size
    moved = 2 * (world - 1) / world * (_LARGE - _SMALL)
    bandwidth = moved / max(
        times[_LARGE] - times[_SMALL], (1 - _LATENCY_SHARE) * times[_LARGE], 1e-9
    )
    # (where the bound holds, the large message's time less its bytes: the fit passes it)
    latency = max(
        min(
            times[_SMALL] - 2 * (world - 1) / world * _SMALL / bandwidth,
            times[_LARGE] - 2 * (world - 1) / world * _LARGE / bandwidth,
        ),
        0.0,
    )
    return Link(latency, bandwidth, issue)
