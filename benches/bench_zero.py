"""Our ZeRO stages against torch FSDP2 and torch DDP, in the same processes, on the same model.

Each world size starts ``--ranks`` processes (``_harness.py``'s launcher: torchrun-style env,
our group on MASTER_PORT, torch's on its own TCPStore). Every rank builds, from deep copies of
the same initial model (the main job's ``TinyGPT``) and AdamW:

- ``zero1``, ``zero2``, ``zero3``: ``sl.distribute(model, opt, strategy=...)`` on our group
  (native engine on CPU, NCCL on CUDA);
- ``fsdp2``: torch's ``fully_shard`` on every transformer block, then on the root (the standard
  manual wrapping), on torch's group (Gloo on CPU, NCCL on CUDA);
- ``ddp``: ``torch.nn.parallel.DistributedDataParallel`` on torch's group.

Two passes per world size:

1. memory, one implementation at a time: build it, run ``--warmup`` steps, record the rank's
   persistent bytes (parameters + gradients + optimizer state it holds: unique storages, or
   ``model.memory_stats()`` where ours has it) and, on CUDA, the peak allocated memory of those
   steps above what was allocated before the build; then free everything and note what
   ``del`` did not give back. cuBLAS's workspaces are allocated by a warm-up GEMM before the
   first build, so they count for no implementation. On CPU only the persistent bytes are
   reported: peak RSS of a process that hosts all implementations is not per implementation.
2. time: all implementations alive, ``--warmup`` steps each, then ``--repeats`` timed blocks of
   ``--steps`` steps that alternate between them (same batches, same order); a cell is the
   slowest rank's median step time. With ``--sequential`` (models too large to keep several
   copies) each implementation is timed right after its memory pass instead, then freed. The
   rank-mean loss of each implementation's last step is compared with FSDP2's (or the first
   implementation's): more than 1e-3 relative is flagged.

Writes JSON, a text table and (with matplotlib) a PNG to ``benches/results/zero-<tag>.*``.

    python benches/bench_zero.py --ranks 2                          # CPU, here, small model
    python benches/bench_zero.py --ranks 2 --impls ddp,fsdp2        # torch only
    python benches/bench_zero.py --device cuda --ranks 2 --size large
    python benches/bench_zero.py --device cuda --ranks 1 4 --size xl \
        --impls zero3,fsdp2,zero3-offload,zero3-offload-cpu,fsdp2-offload
    python benches/bench_zero.py --device cuda --ranks 1 --size 6b --sequential \
        --impls zero3,zero3-offload-cpu,fsdp2-offload --warmup 1 --steps 2 --repeats 1
    python benches/bench_zero.py --device cuda --ranks 2 --size large --dtype bf16 \
        --impls zero3,fsdp2,zero3-sel,fsdp2-sel [--batch 16]   # recompute="selective"
    python benches/bench_zero.py --device cuda --ranks 2 --size large --dtype bf16 \
        --impls zero3,fsdp2,zero3-sel --batch max   # each at the largest batch it fits

``--batch max`` first measures each implementation's peak at the size's batch and at twice
it, and runs it at the batch where a line through those two peaks meets 90 % of the free GPU
memory (the smallest over ranks); the goal is then tokens/s against FSDP2 at its own largest.
It implies ``--sequential``: each fills the GPU alone.

The largest model that trains with offload: one implementation per run, so the model is handed
over rather than copied, and the host memory it holds (after the warm-up, and the process's peak
with building the model) counts from before the model was built:

    python benches/bench_zero.py --device cuda --ranks 1 --size 7b --sequential \
        --impls zero3-offload-cpu --warmup 1 --steps 2 --repeats 1   # then fsdp2-offload

The table and plot are in ``_zero_report.py``.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import _harness
import _report
from _zero_report import (
    DET_IMPLS,
    IMPLS,
    MEM_KEYS,
    MIB,
    OFFLOAD_IMPLS,
    OURS,
    RECOMPUTE_IMPLS,
    UNIT_IMPLS,
    plot,
    progress,
    table,
)

ALL_IMPLS = IMPLS + RECOMPUTE_IMPLS + UNIT_IMPLS + OFFLOAD_IMPLS + DET_IMPLS
MB = "microbatch"  # deterministic="microbatch" (``-mb``, ``-mb2``)
# (d_model, num_layers, num_heads, seq_len, batch_size per rank)
SIZES = {
    "small": (256, 4, 4, 64, 8),  # 3.2M parameters, for 2 CPU cores
    "medium": (1024, 8, 16, 512, 8),  # 101M
    "large": (1280, 20, 20, 1024, 8),  # 394M
    "xl": (2048, 20, 16, 1024, 8),  # 1.01B (bench_scaling.py's model)
    # For offload (with --sequential: one implementation in host memory at a time)
    "3b": (3072, 26, 24, 1024, 2),  # 2.9B
    "6b": (4096, 30, 32, 1024, 1),  # 6.0B: its fp32 AdamW state alone fills an 80 GB GPU
    # The largest that train with offload in 128 GiB of host memory (one implementation per
    # run: the model itself is handed over, not a copy of it)
    "5b": (3072, 44, 24, 1024, 1),  # 5.0B
    "7b": (3072, 62, 24, 1024, 1),  # 7.0B
}


# -- worker --------------------------------------------------------------------------------------


def fully_shard_fn() -> Any:
    """torch's FSDP2 ``fully_shard`` (public since torch 2.6, composable before)."""
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: PLC0415
    except ImportError:
        from torch.distributed._composable.fsdp import fully_shard  # type: ignore[attr-defined]  # noqa: PLC0415
    return fully_shard


def local(t: Any) -> Any:
    """The rank-local tensor of a DTensor (FSDP2's parameters, gradients, optimizer state)."""
    return getattr(t, "_local_tensor", t)


def storage_bytes(tensors: Any) -> int:
    """Bytes of the unique (non-empty) storages behind ``tensors`` (``None`` skipped)."""
    seen: dict[tuple[str, int], int] = {}
    for t in tensors:
        if t is None:
            continue
        s = local(t).untyped_storage()
        if s.nbytes():
            seen[(str(s.device), s.data_ptr())] = s.nbytes()
    return sum(seen.values())


def optimizer_tensors(opt: Any) -> list[Any]:
    import torch  # noqa: PLC0415

    return [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]


def persistent_bytes(model: Any, opt: Any) -> int:
    """Bytes this rank holds for parameters, gradients, buffers and optimizer state: unique
    storages of ``model``'s parameters (and, for a wrapper, its ``.module``'s: ours' gathered
    ones), their gradients, buffers, ``opt``'s parameters, gradients and state tensors."""
    params = list(model.parameters())
    inner = getattr(model, "module", None)
    if inner is not None:
        params += list(inner.parameters())
    for group in opt.param_groups:
        params += list(group["params"])
    tensors = params + [p.grad for p in params] + list(model.buffers())
    return storage_bytes(tensors + optimizer_tensors(opt))


def memory_breakdown(model: Any, opt: Any) -> tuple[int, dict[str, int] | None]:
    """(persistent bytes, the breakdown by ours' ``model.memory_stats()`` if the wrapper has
    it: its keys plus ``optimizer``, the optimizer state's storages, where it lacks that key)."""
    stats = getattr(model, "memory_stats", None)
    if not callable(stats):
        return persistent_bytes(model, opt), None
    d = {k: int(v) for k, v in stats().items() if isinstance(v, int | float)}
    d.setdefault("optimizer", storage_bytes(optimizer_tensors(opt)))
    return sum(d.values()), d


def resident_bytes() -> int:
    """This process's resident set (``/proc/self/statm``), in bytes; 0 where there is none."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def peak_resident_bytes() -> int:
    """This process's peak resident set (``VmHWM``), in bytes; 0 where there is none."""
    try:
        with open("/proc/self/status") as f:
            line = next(x for x in f if x.startswith("VmHWM:"))
        return int(line.split()[1]) * 1024
    except (OSError, StopIteration):
        return 0


def build_impl(
    name: str,
    base: Any,
    device: Any,
    lr: float,
    zero_kw: dict[str, Any],
    dtype: str = "fp32",
) -> tuple[Any, Any]:
    """A copy of ``base`` (or the model itself, taken out of ``base`` when that is a one-item
    list) on ``device`` wrapped as ``name``, and its AdamW: ours through
    ``sl.distribute`` (``zero1``-``zero3``, or ``sl-<strategy>`` for any of our strategies),
    FSDP2 (``fsdp2``) with ``fully_shard`` per block then the root, else torch DDP on the
    default group (``ddp``, ``torch-ddp``). ``dtype="bf16"``: bf16 compute on fp32 master
    weights, gradients reduced in fp32 (ours: ``MixedPrecision``, FSDP2:
    ``MixedPrecisionPolicy``; DDP runs in fp32 only here and is refused)."""
    import copy  # noqa: PLC0415

    import torch  # noqa: PLC0415
    from torch.nn.parallel import DistributedDataParallel as TorchDDP  # noqa: PLC0415

    import shardline as sl  # noqa: PLC0415

    model: Any = base.pop() if isinstance(base, list) else copy.deepcopy(base)  # on the CPU
    bf16 = dtype == "bf16"
    if name.endswith("-sel"):
        name = name.removesuffix("-sel")
        if name in OURS:
            zero_kw = {**zero_kw, "recompute": "selective"}
        else:
            sl.parallel.recompute.recompute_blocks(model, "selective")
    name = name.removesuffix("-acc2")  # (two backwards a step: ``step``)
    for suffix, mode in (("-det", True), ("-rep", "repeat"), ("-mb", MB), ("-mb2", MB)):
        if name.endswith(suffix):
            name = name.removesuffix(suffix)
            zero_kw = {**zero_kw, "deterministic": mode}
    for rule in ("blocks", "size"):
        if name.endswith(f"-{rule}"):
            name = name.removesuffix(f"-{rule}")
            zero_kw = {**zero_kw, "units": rule}
    if bf16 and name.startswith("zero"):
        zero_kw = {
            **zero_kw,
            "mixed_precision": sl.MixedPrecision(
                param_dtype=torch.bfloat16, reduce_dtype=torch.float32
            ),
        }
    if name not in OFFLOAD_IMPLS:
        model = model.to(device)
    # The offloads get the model in host memory, as a model larger than the GPU must come:
    # ours lays it out on the GPU a unit at a time, FSDP2 moves it a block per fully_shard.
    if name in ("zero3-offload", "zero3-offload-cpu"):
        opt = sl.optim.CPUAdamW(model.parameters(), lr=lr, weight_decay=0.01)
        offload = "cpu" if name.endswith("-cpu") else "optimizer"
        return sl.distribute(model, opt, strategy="zero3", offload=offload, **zero_kw)
    if name in OURS or name.startswith("sl-"):
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        return sl.distribute(model, opt, strategy=name.removeprefix("sl-"), **zero_kw)
    if name in ("fsdp2", "fsdp2-offload"):
        fully_shard = fully_shard_fn()
        kw: dict[str, Any] = {}
        if bf16:
            from torch.distributed.fsdp import MixedPrecisionPolicy  # noqa: PLC0415

            kw["mp_policy"] = MixedPrecisionPolicy(
                param_dtype=torch.bfloat16, reduce_dtype=torch.float32
            )
        if name == "fsdp2-offload":
            from torch.distributed.fsdp import CPUOffloadPolicy  # noqa: PLC0415

            kw["offload_policy"] = CPUOffloadPolicy()
        if device.type == "cpu":
            # fully_shard's default mesh is on CUDA wherever CUDA exists: on a host with fewer
            # GPUs than ranks, ranks past them fail in set_device. A CPU run says CPU.
            from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415

            kw["mesh"] = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
        for block in model.blocks:
            fully_shard(block, **kw)
        fully_shard(model, **kw)
    else:
        if bf16:
            raise ValueError("--dtype bf16: this bench runs DDP in fp32 only (leave ddp out)")
        model = TorchDDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    return model, torch.optim.AdamW(model.parameters(), lr=lr)


def worker(args: argparse.Namespace) -> int:
    import gc  # noqa: PLC0415

    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    from shardline.examples.train import Config, TinyGPT, corpus  # noqa: PLC0415

    rank, world, device, _ = _harness.join_job(args.device)
    cuda = device.type == "cuda"
    if args.batch.get("*") == "max" and not cuda:
        raise SystemExit("--batch max needs --device cuda (it fits the batch to the GPU memory)")
    # Each at its largest batch fills the GPU alone: implementations are timed one at a time.
    args.sequential = args.sequential or args.batch.get("*") == "max"

    def free() -> None:
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
            # Pinned host memory torch's caching host allocator keeps after it is freed.
            getattr(torch._C, "_host_emptyCache", lambda: None)()

    d_model, layers, heads, seq_len, batch = SIZES[args.size]
    batch = int(args.batch.get("*", 0)) if args.batch.get("*") != "max" else 0
    batch = batch or SIZES[args.size][4]
    cfg = Config(
        d_model=d_model, num_layers=layers, num_heads=heads, seq_len=seq_len, batch_size=batch
    )
    torch.manual_seed(0)
    start_rss = resident_bytes()
    base: Any = TinyGPT(cfg)  # on the CPU; each implementation moves its own copy
    n_params = sum(p.numel() for p in base.parameters())
    # Each rank its own windows of the built-in corpus (real text, so the loss moves); the
    # same windows for every implementation that runs the same batch size.
    tokens = corpus(num_chars=200_000)
    n_windows = (tokens.numel() - 1) // seq_len
    data: dict[int, list[tuple[Any, Any]]] = {}

    def batches(size: int) -> list[tuple[Any, Any]]:
        if size not in data:
            gen = torch.Generator().manual_seed(1000 + rank)
            data[size] = []
            for _ in range(4):
                idx = torch.randint(0, n_windows, (size,), generator=gen).tolist()
                win = torch.stack([tokens[i * seq_len : i * seq_len + seq_len + 1] for i in idx])
                data[size].append((win[:, :-1].to(device), win[:, 1:].to(device)))
        return data[size]

    impls = [i for i in ALL_IMPLS if i in args.impls]
    batch_of = {n: int(args.batch.get(n, batch)) for n in impls}  # "max": set below

    # One implementation, timed right after its memory pass, at the size's batch: it is handed
    # the model itself (no copy kept), so its host memory counts from before the model was built.
    handed_over = args.sequential and len(impls) == 1 and args.batch.get("*") != "max"
    if handed_over:
        base = [base]

    def build(name: str) -> tuple[Any, Any]:
        return build_impl(name, base, device, args.lr, args.zero_kw, args.dtype)

    def step(name: str, model: Any, opt: Any, counter: list[int]) -> Any:
        # Repeatable mode turns torch's deterministic algorithms on, and their filling of new
        # tensors off, for the whole process; the implementations alternate here, so each
        # step runs with its own choice (the others: torch's defaults).
        repeat = name.endswith(("-rep", "-mb", "-mb2"))
        torch.use_deterministic_algorithms(repeat)
        torch.utils.deterministic.fill_uninitialized_memory = not repeat  # type: ignore[attr-defined]
        chosen = batches(batch_of[name])
        x, y = chosen[counter[0] % len(chosen)]
        counter[0] += 1
        opt.zero_grad(set_to_none=True)
        # Micro-batch mode: one backward per micro-batch, the rank's batch as one (``-mb``) or
        # as two halves (``-mb2``: what one rank runs to match two at this batch); ``-acc2``:
        # two halves without the mode (gradient accumulation, the cost ``-mb2`` adds to).
        parts = 2 if name.endswith(("-mb2", "-acc2")) else 1
        n = x.shape[0] // parts
        total = 0.0
        for k in range(parts):
            loss = model(x[k * n : (k + 1) * n], y[k * n : (k + 1) * n])
            loss = loss / parts if parts > 1 else loss
            loss.backward()
            total = total + loss.detach()
        opt.step()
        return total

    errors: dict[str, str] = {}
    rows: dict[str, dict[str, Any]] = {i: {} for i in impls}

    def failed(name: str, what: str) -> None:
        # Every rank says so at once: a rank that failed alone leaves the others waiting in
        # the implementation's next collective, and only its own output names the cause.
        errors[name] = f"{what}: {traceback.format_exc()}"
        print(f"[world {world}, rank {rank}] {name} failed during {what}:\n{errors[name]}",
              flush=True)  # fmt: skip

    times: dict[str, list[float]] = {}
    losses: dict[str, Any] = {}

    def timed_blocks(
        name: str, model: Any, opt: Any, counter: list[int], repeats: int | None = None
    ) -> None:
        for _ in range(args.repeats if repeats is None else repeats):
            dist.barrier()
            _harness.sync(device)
            t0 = time.perf_counter()
            for _ in range(args.steps):
                loss = step(name, model, opt, counter)
            _harness.sync(device)
            times.setdefault(name, []).append((time.perf_counter() - t0) / args.steps)
            losses[name] = loss

    def fit_batch(name: str) -> int:
        """The largest batch per rank that fits: peaks at two batch sizes, a line through them,
        90 % of the memory free now; the smallest over ranks."""
        peaks = []
        sizes = (batch, 2 * batch)
        for size in sizes:
            free()
            base_alloc = torch.cuda.memory_allocated()
            model, opt = build(name)
            torch.cuda.reset_peak_memory_stats()
            counter, batch_of[name] = [0], size
            for _ in range(2):
                step(name, model, opt, counter)
            _harness.sync(device)
            peaks.append(torch.cuda.max_memory_allocated() - base_alloc)
            del model, opt
        free()
        per_seq = max(1, (peaks[1] - peaks[0]) // (sizes[1] - sizes[0]))
        fixed = peaks[0] - per_seq * sizes[0]
        room = int(0.9 * torch.cuda.mem_get_info(device)[0])
        fits = torch.tensor([max(1, (room - fixed) // per_seq)], device=device)
        dist.all_reduce(fits, op=dist.ReduceOp.MIN)
        rows[name]["fit"] = {"per_sequence_bytes": per_seq, "fixed_bytes": fixed, "room": room}
        return int(fits.item())

    # Pass 1: memory, one implementation alive at a time.
    if cuda:
        # cuBLAS allocates its workspaces (32 MiB and more per handle: one for this thread,
        # one for autograd's backward thread) through the caching allocator at its first
        # GEMM and keeps them; without this warm-up they would count in the peak of whichever
        # implementation runs first.
        w = torch.randn(256, 256, device=device, requires_grad=True)
        (w @ w).sum().backward()
        del w
        _harness.sync(device)
    if args.batch.get("*") == "max":
        for name in impls:
            try:
                batch_of[name] = fit_batch(name)
            except Exception:
                failed(name, "fitting the batch")
            if rank == 0 and name not in errors:
                fit = rows[name]["fit"]
                print(
                    f"[world {world}] {name}: {fit['per_sequence_bytes'] / MIB:,.1f} MiB per "
                    f"sequence over {fit['fixed_bytes'] / MIB:,.1f} MiB: batch {batch_of[name]}",
                    flush=True,
                )
    for name in impls:
        if name in errors:
            continue
        free()
        base_alloc = torch.cuda.memory_allocated() if cuda else 0
        base_rss = start_rss if handed_over else resident_bytes()
        model = opt = None
        try:
            model, opt = build(name)
            if rank == 0 and hasattr(model, "plan"):
                rows[name]["plan"] = str(model.plan())
                head = rows[name]["plan"].splitlines()[0]
                print(f"[world {world}] {name}: {head} (whole plan in the JSON)", flush=True)
            _harness.sync(device)
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            counter = [0]
            for _ in range(args.warmup):
                step(name, model, opt, counter)
            _harness.sync(device)
            persistent, own = memory_breakdown(model, opt)
            rows[name]["persistent_generic_bytes"] = persistent_bytes(model, opt)
            if own is not None:
                rows[name]["memory_stats"] = own
            rows[name]["persistent_bytes"] = persistent
            if cuda:
                rows[name]["peak_bytes"] = torch.cuda.max_memory_allocated() - base_alloc
                host_stats = getattr(torch.cuda, "host_memory_stats", None)
                if callable(host_stats):
                    rows[name]["pinned"] = {
                        k: v for k, v in host_stats().items() if k.endswith("bytes.current")
                    }
            # Host memory this implementation holds after its warm-up steps (pinned memory
            # included: it is resident), above what the process held before it was built.
            rows[name]["host_bytes"] = resident_bytes() - base_rss
            if handed_over:  # the process's peak: this implementation's, model building included
                rows[name]["host_peak_bytes"] = peak_resident_bytes() - start_rss
            if args.sequential:
                timed_blocks(name, model, opt, counter)
        except Exception:  # ours may be unfinished: report, go on
            failed(name, "memory pass")
        del model, opt
        free()
        if cuda:  # what ``del model, opt`` did not give back (peaks count from base_alloc)
            rows[name]["left_after_del_bytes"] = torch.cuda.memory_allocated() - base_alloc

    # Pass 2: time, all alive, alternating blocks.
    # Pass 2: time, every implementation alive, blocks alternating between them.
    alive: dict[str, tuple[Any, Any, list[int]]] = {}
    for name in impls if not args.sequential else ():
        if name in errors:
            continue
        try:
            model, opt = build(name)
            counter = [0]
            for _ in range(args.warmup):
                step(name, model, opt, counter)
            alive[name] = (model, opt, counter)
        except Exception:
            failed(name, "timing warm-up")
    _harness.sync(device)
    for _ in range(args.repeats if alive else 0):
        for name, (model, opt, counter) in list(alive.items()):
            try:
                timed_blocks(name, model, opt, counter, repeats=1)
            except Exception:
                failed(name, "timed steps")
                del alive[name]

    # Slowest rank's median step time, max over ranks of the memory, mean over ranks of the loss.
    names = [n for n in impls if times.get(n)]
    nan = float("nan")
    med = torch.tensor([statistics.median(times[n]) for n in names] or [0.0], dtype=torch.float64)
    mem = torch.tensor(
        [float(rows[n].get(k, nan)) for n in impls for k in MEM_KEYS],
        dtype=torch.float64,
    )
    lss = torch.tensor([float(losses[n]) for n in names] or [0.0], dtype=torch.float64)
    for t, op in ((med, dist.ReduceOp.MAX), (mem, dist.ReduceOp.MAX), (lss, dist.ReduceOp.SUM)):
        t_dev = t.to(device)
        dist.all_reduce(t_dev, op=op)
        t.copy_(t_dev.cpu())
    lss /= world
    for i, n in enumerate(impls):
        for j, k in enumerate(MEM_KEYS):
            v = float(mem[len(MEM_KEYS) * i + j])
            rows[n][k] = None if math.isnan(v) else v
    for n, t, lo in zip(names, med.tolist()[: len(names)], lss.tolist()[: len(names)], strict=True):
        items = batch_of[n] * seq_len * world  # tokens per step, all ranks
        rows[n].update(step_ms=t * 1e3, tokens_per_s=items / t, loss=lo, batch_per_rank=batch_of[n])
        rows[n]["block_ms"] = [b * 1e3 for b in times[n]]  # this rank's blocks, in order
    for n in impls:
        if n in errors:
            rows[n]["error"] = errors[n]
    result = {
        "params": n_params,
        "tokens_per_step": batch * seq_len * world,
        "config": {
            "d_model": d_model,
            "layers": layers,
            "heads": heads,
            "seq_len": seq_len,
            "batch_per_rank": batch,
            "dtype": args.dtype,
        },
        "impls": rows,
    }
    alive.clear()
    return _harness.leave_job(rank, result, args.out)


def batch_spec(text: str) -> dict[str, int | str]:
    """``--batch``: ``"16"``, ``"max"`` or ``"zero3-sel=96,fsdp2=64,*=16"``."""
    if text in ("", "0"):
        return {}
    if text == "max" or text.isdigit():
        return {"*": text if text == "max" else int(text)}
    spec: dict[str, int | str] = {}
    for item in text.split(","):
        name, _, value = item.partition("=")
        if not value.isdigit() or int(value) < 1:
            raise argparse.ArgumentTypeError(f"{item!r}: want impl=N with N >= 1")
        spec[name.strip()] = int(value)
    return spec


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    _harness.add_subset(p, "--impls", ALL_IMPLS)
    p.set_defaults(impls=list(IMPLS))  # the offloads only when asked for
    p.add_argument("--size", default="small", choices=list(SIZES))
    p.add_argument(
        "--batch",
        type=batch_spec,
        default={},
        help="sequences per rank: N for all, impl=N,... per implementation (*=N the rest), or "
        "max: the most each fits (CUDA; from its peaks at the size's batch and twice it)",
    )
    p.add_argument(
        "--dtype",
        default="fp32",
        choices=["fp32", "bf16"],
        help="bf16: bf16 compute, fp32 master weights and gradient reductions",
    )
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    repeats_help = "timed blocks per implementation"
    _harness.add_blocks(p, steps=5, repeats=3, warmup=2, repeats_help=repeats_help)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument(
        "--sequential",
        action="store_true",
        help="time each implementation right after its memory pass (one alive at a time)",
    )
    _harness.add_launch(p, timeout=600.0, timeout_help="seconds per world size")
    _harness.add_kw(p, "--zero-kw", "options for our ZeRO wrapper, e.g. unit_mb=32,prefetch=2")
    args, results = _harness.run_bench(p, argv, __file__, worker, progress)
    cores = os.cpu_count()
    tag = args.tag or f"{args.device}-{cores}c-{args.size}"
    first = next(iter(results.values()))
    model = f"; TinyGPT {first['params'] / 1e6:.1f}M params {first['config']}, AdamW"
    _report.publish(
        _report.RESULTS / f"zero-{tag}",
        _report.header(Path(__file__).name, _report.machine(args.device) + model),
        table(results, args.device),
        {"args": vars(args), "cores": cores, "results": results},
        lambda path: plot(results, path, args.device),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
