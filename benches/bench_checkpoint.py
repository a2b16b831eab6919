"""Checkpoint save and load: ours against torch.save, safetensors and torch DCP, and the disk.

One process (world size 1) builds a transformer-ish state of ``--gb`` GB (10^9 bytes): the main
job's ``TinyGPT`` (8 blocks, ``d_model`` chosen to fit) with AdamW after one optimizer step on
synthetic gradients (``randn * 1e-3``: no untouched rows that would flatter compression), so the
state is parameters + ``exp_avg`` + ``exp_avg_sq`` (+ a scalar ``step`` each), all in
``--dtype``. Contenders, in rounds (one repeat of each; the order shuffled after the first
round), each writing into a fresh directory under ``--dir``:

- ``ours``, ``ours-zstd``: ``shardline.checkpoint.save(path, model=, optimizer=)``, plain and
  ``compress=--zstd-level``; load: ``checkpoint.load(path, model=model2, optimizer=opt2)``;
- ``ours-async``, ``ours-zstd-async``: the same with ``async_=True``: "blocking" is the time
  until ``save`` returns, "save" the time until ``handle.wait()`` returns (the files are those
  of the sync variants, so no loads);
- ``torch``: ``torch.save({"model": sd, "optim": osd}, file)``, then ``os.fsync`` of the file
  and its directory; loads: ``torch.load(weights_only=True)`` and ``torch.load(mmap=True)``
  (mmap'd optimizer tensors are cloned: ``load_state_dict`` would keep them as lazily read
  views of the file) followed by ``model2.load_state_dict`` / ``opt2.load_state_dict``;
- ``safetensors``: ``save_file`` of the model (tied tensors once) and the optimizer state under
  flat names (param groups in the metadata), fsync; ``load_file`` + ``load_state_dict``;
- ``dcp``, ``dcp-async``: ``torch.distributed.checkpoint.save`` / ``async_save`` of
  ``get_state_dict(model, opt)`` (no process group: DCP's single-process mode; its
  ``FileSystemWriter`` defaults, ``sync_files=True`` fsyncs every file, one thread);
  load: ``dcp.load`` into ``get_state_dict(model2, opt2)`` + ``set_state_dict``;
- ``disk``: ``dd if=/dev/zero bs=16M conv=fsync`` of the state's byte count (and the same
  count of a random 16 MiB block with ``os.write`` + ``os.fsync``, in case the storage
  special-cases zeros, and with ``O_DIRECT``, which streams to the disk instead of filling the
  page cache first), and ``dd`` reading the file back after eviction. "% disk" divides by
  the fastest of the three writes (so the goal is not flattered by one slow probe).

Every timed save (and disk write) starts after ``os.sync()`` and ``--settle`` s of idle disk (a
virtual disk can be slow right after a burst of writes or deletes); round r's directories are
deleted after the round. Saves include the state-dict calls and every fsync the writer does
(ours and DCP fsync themselves). Loads are timed twice: "warm" right after
the save (from the page cache: without root the cache cannot be dropped) and "cold" after each
file was fsynced and evicted with ``posix_fadvise(POSIX_FADV_DONTNEED)`` (works without root
for clean pages; the drop of ``Cached`` in /proc/meminfo is recorded as a check). On a virtual
disk the host may still cache what the guest evicted. Before each cold load ``model2`` and
``opt2`` are zeroed; after the last one they are compared with the saved state bit for bit
(``check``). A cell is the median of ``--repeats``; GB/s divide the state's logical bytes
(so zstd speeds are effective speeds); ``vs DCP`` = DCP's time / the contender's. A contender
that raises is reported FAILED and dropped from later rounds; ``ours*`` are SKIPPED while the
extension has no ``write_shard`` (rebuild it). ``--zstd-dtypes`` adds a pass per other dtype
(default: bf16 when ``--dtype fp32``) with only ``ours`` and ``ours-zstd``, for the zstd ratio
and speed on those weights. Multi-rank saves (``--ranks N``) are left for later.

Writes JSON, a text table and (with matplotlib) a PNG to
``benches/results/checkpoint-<tag>.*``; the temporary directory is removed at the end.

    python benches/bench_checkpoint.py --gb 0.25                  # here, ~1 min
    python benches/bench_checkpoint.py                            # 1 GB, ~3.5 min on 2 cores
    python benches/bench_checkpoint.py --impls torch,safetensors,dcp,disk   # without ours
    python benches/bench_checkpoint.py --dtype bf16 --zstd-dtypes bf16
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import _harness
import _report

IMPLS = (
    "ours",
    "ours-zstd",
    "ours-async",
    "ours-zstd-async",
    "torch",
    "safetensors",
    "dcp",
    "dcp-async",
    "disk",
)
OURS = ("ours", "ours-zstd", "ours-async", "ours-zstd-async")
SYNC_OF = {"ours-async": "ours", "ours-zstd-async": "ours-zstd", "dcp-async": "dcp"}
GB = 1e9
BLOCK = 16 << 20
NUM_LAYERS = 8


# -- the state -----------------------------------------------------------------------------------


def torch_dtype(name: str) -> Any:
    import torch  # noqa: PLC0415

    return {"fp32": torch.float32, "bf16": torch.bfloat16}[name]


def build_state(gb: float, dtype: str) -> tuple[Any, Any, dict[str, Any]]:
    """(model, AdamW after one step, description) holding about ``gb`` GB in ``dtype``."""
    import torch  # noqa: PLC0415

    from shardline.examples.train import Config, TinyGPT  # noqa: PLC0415

    elt = 4 if dtype == "fp32" else 2
    params_wanted = gb * GB / (3 * elt)  # weights + exp_avg + exp_avg_sq
    d = max(32, round(math.sqrt(params_wanted / (12 * NUM_LAYERS)) / 32) * 32)
    cfg = Config(d_model=d, num_layers=NUM_LAYERS, num_heads=4, seq_len=64)
    torch.manual_seed(0)
    model = TinyGPT(cfg).to(torch_dtype(dtype))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    for p in model.parameters():
        p.grad = (torch.randn(p.shape, generator=gen) * 1e-3).to(p.dtype)
    opt.step()
    opt.zero_grad(set_to_none=True)
    nbytes, tensors = state_bytes(model, opt)
    desc = {
        "dtype": dtype,
        "d_model": d,
        "num_layers": NUM_LAYERS,
        "params": sum(p.numel() for p in model.parameters()),
        "tensors": tensors,
        "bytes": nbytes,
    }
    return model, opt, desc


def state_bytes(model: Any, opt: Any) -> tuple[int, int]:
    """Bytes and tensor count of the parameters (tied ones once) and the optimizer state."""
    n, count = 0, 0
    for p in model.parameters():  # removes duplicates (the tied head)
        n += p.numel() * p.element_size()
        count += 1
        for v in opt.state[p].values():
            n += v.numel() * v.element_size()
            count += 1
    return n, count


def make_target(model: Any, opt: Any) -> tuple[Any, Any]:
    """A second model and optimizer, same structure, own storage, to load into."""
    import torch  # noqa: PLC0415

    model2 = copy.deepcopy(model)  # keeps the tie
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-3)
    for p, p2 in zip(model.parameters(), model2.parameters(), strict=True):
        opt2.state[p2] = {k: v.clone() for k, v in opt.state[p].items()}
    zero_state(model2, opt2)
    return model2, opt2


def zero_state(model: Any, opt: Any) -> None:
    import torch  # noqa: PLC0415

    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
            for v in opt.state[p].values():
                v.zero_()


def compare(model: Any, opt: Any, model2: Any, opt2: Any) -> str:
    """``ok`` when ``model2`` / ``opt2`` equal the saved state bit for bit."""
    import torch  # noqa: PLC0415

    bad = 0
    for p, p2 in zip(model.parameters(), model2.parameters(), strict=True):
        if p.dtype != p2.dtype or not torch.equal(p, p2):
            bad += 1
        s, s2 = opt.state[p], opt2.state.get(p2, {})
        for k, v in s.items():
            w = s2.get(k)
            if not torch.is_tensor(w) or w.dtype != v.dtype or not torch.equal(v, w.to(v.device)):
                bad += 1
    g, g2 = opt.param_groups[0], opt2.param_groups[0]
    if any(g[k] != g2[k] for k in ("lr", "betas", "eps", "weight_decay")):
        bad += 1
    return "ok" if bad == 0 else f"MISMATCH ({bad} tensors)"


# -- files ---------------------------------------------------------------------------------------


def files_under(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file())


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in files_under(path))


def fsync_path(path: Path, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def quiesce(settle: float) -> None:
    """Flushes every dirty page, then leaves the disk idle ``settle`` s (a virtual disk's host
    may still be writing or discarding what the guest flushed)."""
    os.sync()
    time.sleep(settle)


def cached_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Cached:"):
                return int(line.split()[1]) * 1024
    return 0


def evict(path: Path) -> int:
    """fsyncs and drops every file under ``path`` from the page cache; returns Cached's drop."""
    gc.collect()  # unmaps files that the previous load left mapped
    before = cached_bytes()
    for f in files_under(path) if path.is_dir() else [path]:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return before - cached_bytes()


# -- contenders ----------------------------------------------------------------------------------

SaveFn = Callable[[Path], tuple[float, float]]  # directory -> (blocking s, total s)
LoadFn = Callable[[Path], None]


def timed(fn: Callable[[], Any]) -> tuple[float, float]:
    t0 = time.perf_counter()
    fn()
    t = time.perf_counter() - t0
    return t, t


def contender(
    name: str, model: Any, opt: Any, model2: Any, opt2: Any, args: argparse.Namespace
) -> tuple[SaveFn, dict[str, LoadFn]]:
    """The save and the loads (label -> fn) of ``name``."""
    import torch  # noqa: PLC0415

    if name in OURS:
        from shardline import checkpoint  # noqa: PLC0415

        level = args.zstd_level if "zstd" in name else None
        is_async = name.endswith("-async")

        def save_ours(d: Path) -> tuple[float, float]:
            t0 = time.perf_counter()
            handle = checkpoint.save(
                d / "ckpt", model=model, optimizer=opt, compress=level, async_=is_async
            )
            t1 = time.perf_counter()
            handle.wait()
            return t1 - t0, time.perf_counter() - t0

        def load_ours(d: Path) -> None:
            checkpoint.load(d / "ckpt", model=model2, optimizer=opt2)

        return save_ours, ({} if is_async else {name: load_ours})

    if name == "torch":

        def save_torch(d: Path) -> tuple[float, float]:
            def run() -> None:
                f = d / "state.pt"
                torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, f)
                fsync_path(f)
                fsync_path(d, directory=True)

            return timed(run)

        def load_torch(d: Path, mmap: bool = False) -> None:
            obj = torch.load(d / "state.pt", weights_only=True, mmap=mmap)
            model2.load_state_dict(obj["model"])
            osd = obj["optim"]
            if mmap:  # materialise: load_state_dict keeps the tensors it is given
                osd = {
                    "state": {
                        i: {k: v.clone() for k, v in s.items()} for i, s in osd["state"].items()
                    },
                    "param_groups": osd["param_groups"],
                }
            opt2.load_state_dict(osd)

        return save_torch, {
            "torch.load": load_torch,
            "torch.load mmap": lambda d: load_torch(d, mmap=True),
        }

    if name == "safetensors":
        from safetensors import safe_open  # noqa: PLC0415
        from safetensors.torch import load_file, save_file  # noqa: PLC0415

        def save_st(d: Path) -> tuple[float, float]:
            def run() -> None:
                flat: dict[str, Any] = {}
                seen = set()
                for k, v in model.state_dict().items():
                    key = (v.untyped_storage().data_ptr(), v.storage_offset(), v.shape)
                    if key not in seen:  # tied tensors once (save_file refuses shared ones)
                        seen.add(key)
                        flat[f"model/{k}"] = v
                for pname, p in model.named_parameters():
                    for k, v in opt.state[p].items():
                        flat[f"optim/{pname}/{k}"] = v
                groups = opt.state_dict()["param_groups"]
                f = d / "state.safetensors"
                save_file(flat, str(f), metadata={"param_groups": json.dumps(groups)})
                fsync_path(f)
                fsync_path(d, directory=True)

            return timed(run)

        def load_st(d: Path) -> None:
            f = str(d / "state.safetensors")
            flat = load_file(f)
            with safe_open(f, framework="pt") as sf:
                groups = json.loads(sf.metadata()["param_groups"])
            msd = {k[len("model/") :]: v for k, v in flat.items() if k.startswith("model/")}
            missing, unexpected = model2.load_state_dict(msd, strict=False)
            if unexpected or any(k != "head.weight" for k in missing):
                raise RuntimeError(f"safetensors load: missing {missing}, unexpected {unexpected}")
            per_param: dict[str, dict[str, Any]] = {}
            for k, v in flat.items():
                if k.startswith("optim/"):
                    pname, _, sk = k[len("optim/") :].rpartition("/")
                    per_param.setdefault(pname, {})[sk] = v
            names = [n for n, _ in model2.named_parameters()]
            # load_file's tensors are private mmaps of the file, read lazily: materialise the
            # ones load_state_dict would keep (the model's are copied into its parameters)
            state = {
                i: {k: v.clone() for k, v in per_param[n].items()}
                for i, n in enumerate(names)
                if n in per_param
            }
            for g in groups:  # JSON made the betas tuple a list
                g.update(
                    {k: tuple(v) for k, v in g.items() if k != "params" and isinstance(v, list)}
                )
            opt2.load_state_dict({"state": state, "param_groups": groups})

        return save_st, {"safetensors": load_st}

    if name in ("dcp", "dcp-async"):
        import torch.distributed.checkpoint as _dcp  # noqa: PLC0415
        from torch.distributed.checkpoint.state_dict import (  # noqa: PLC0415
            get_state_dict,
            set_state_dict,
        )

        dcp: Any = _dcp

        def save_dcp(d: Path) -> tuple[float, float]:
            t0 = time.perf_counter()
            msd, osd = get_state_dict(model, opt)
            sd = {"model": msd, "optim": osd}
            if name == "dcp":
                dcp.save(sd, checkpoint_id=str(d / "dcp"))
                t = time.perf_counter() - t0
                return t, t
            fut = dcp.async_save(sd, checkpoint_id=str(d / "dcp"))
            t1 = time.perf_counter()
            fut.result()
            return t1 - t0, time.perf_counter() - t0

        def load_dcp(d: Path) -> None:
            msd, osd = get_state_dict(model2, opt2)
            sd: dict[str, Any] = {"model": msd, "optim": osd}
            dcp.load(sd, checkpoint_id=str(d / "dcp"))
            set_state_dict(model2, opt2, model_state_dict=sd["model"], optim_state_dict=sd["optim"])

        return save_dcp, ({"dcp": load_dcp} if name == "dcp" else {})

    raise ValueError(name)


def disk_round(d: Path, nbytes: int, rand_block: bytes, settle: float) -> dict[str, float]:
    """dd write (zeros, conv=fsync), os.write of a random block + fsync (and with O_DIRECT),
    dd read when evicted."""
    count = max(1, math.ceil(nbytes / BLOCK))
    f = d / "dd.bin"
    quiesce(settle)
    t0 = time.perf_counter()
    subprocess.run(
        ["dd", "if=/dev/zero", f"of={f}", "bs=16M", f"count={count}", "conv=fsync", "status=none"],
        check=True,
    )
    t_dd = time.perf_counter() - t0
    fsync_path(d, directory=True)
    evicted = evict(f)
    t0 = time.perf_counter()
    subprocess.run(["dd", f"if={f}", "of=/dev/null", "bs=16M", "status=none"], check=True)
    t_read = time.perf_counter() - t0
    f.unlink()
    g = d / "rand.bin"
    quiesce(settle)
    t0 = time.perf_counter()
    fd = os.open(g, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for _ in range(count):
            view = memoryview(rand_block)
            while view:
                view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    t_rand = time.perf_counter() - t0
    g.unlink()
    direct = d / "direct.bin"
    try:
        t_direct = direct_write(direct, count, rand_block, settle)
        t_direct_read = direct_read(direct) if t_direct is not None else None
    finally:
        direct.unlink(missing_ok=True)
    return {
        "bytes": count * BLOCK,
        "dd_write": t_dd,
        "rand_write": t_rand,
        "direct_write": t_direct,
        "dd_read_cold": t_read,
        "direct_read": t_direct_read,
        "evicted": evicted,
    }


def direct_write(path: Path, count: int, rand_block: bytes, settle: float) -> float | None:
    """Seconds to write ``count`` random blocks to ``path`` with O_DIRECT (no page cache: the
    disk's streaming speed) + fsync; ``None`` where the filesystem refuses O_DIRECT (tmpfs).
    The caller removes the file."""
    import mmap  # noqa: PLC0415

    buf = mmap.mmap(-1, len(rand_block))  # page-aligned, as O_DIRECT needs
    buf.write(rand_block)
    quiesce(settle)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    except OSError:
        return None
    whole = memoryview(buf)
    try:
        t0 = time.perf_counter()
        for _ in range(count):
            done = 0
            while done < len(whole):
                done += os.write(fd, whole[done:])
        os.fsync(fd)
        return time.perf_counter() - t0
    except OSError:
        return None
    finally:
        os.close(fd)
        whole.release()
        buf.close()


def direct_read(path: Path, threads: int = 8, request: int = 4 << 20) -> float | None:
    """Seconds to read ``path`` with O_DIRECT on ``threads`` threads in ``request``-byte
    pieces: the disk's parallel read speed without the page cache, which no loader of a cold
    file can beat; ``None`` where O_DIRECT is refused."""
    import mmap  # noqa: PLC0415

    size = path.stat().st_size
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        return None
    bufs = [mmap.mmap(-1, request) for _ in range(threads)]  # page-aligned

    def worker(i: int) -> None:
        off = i * request
        while off < size:
            os.preadv(fd, [bufs[i]], off)
            off += threads * request

    try:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(worker, range(threads)))
        return time.perf_counter() - t0
    except OSError:
        return None
    finally:
        os.close(fd)
        for b in bufs:
            b.close()


# -- one pass: every contender, --repeats rounds --------------------------------------------------


def run_pass(dtype: str, impls: list[str], args: argparse.Namespace, work: Path) -> dict[str, Any]:
    model, opt, desc = build_state(args.gb, dtype)
    model2, opt2 = make_target(model, opt)
    nbytes = desc["bytes"]
    print(
        f"[{dtype}] state {nbytes / GB:.3f} GB: TinyGPT d_model {desc['d_model']} x "
        f"{desc['num_layers']} layers, {desc['params'] / 1e6:.1f}M params, {desc['tensors']} "
        "tensors (params + AdamW state)",
        flush=True,
    )
    rows: dict[str, dict[str, Any]] = {}
    fns: dict[str, tuple[SaveFn, dict[str, LoadFn]]] = {}
    for name in impls:
        if name == "disk":
            rows[name] = {"rounds": []}
            continue
        row: dict[str, Any] = {"save": [], "blocking": [], "bytes": None, "loads": {}}
        rows[name] = row
        if name in OURS:
            from shardline import _native  # noqa: PLC0415

            if not hasattr(_native, "write_shard"):
                row["skipped"] = "shardline._native has no write_shard (rebuild the extension)"
                continue
        try:
            fns[name] = contender(name, model, opt, model2, opt2, args)
        except Exception:  # an import that fails: reported, the rest go on
            row["error"] = traceback.format_exc()
            print(f"[{dtype}] {name} FAILED:\n{row['error']}", file=sys.stderr, flush=True)
            continue
        for label in fns[name][1]:
            row["loads"][label] = {"warm": [], "cold": [], "evicted": []}
    rand_block = os.urandom(BLOCK)
    for r in range(args.repeats):
        order = list(impls)  # shuffled after the first round: no fixed neighbours
        if r:
            random.Random(r).shuffle(order)
        for name in order:
            row = rows[name]
            d = work / f"{dtype}-{name}-{r}"
            d.mkdir(parents=True)
            try:
                if name == "disk":
                    row["rounds"].append(disk_round(d, nbytes, rand_block, args.settle))
                    continue
                if name not in fns or "error" in row:
                    continue
                save, loads = fns[name]
                gc.collect()
                quiesce(args.settle)
                blocking, total = save(d)
                row["blocking"].append(blocking)
                row["save"].append(total)
                row["bytes"] = dir_bytes(d)
                for label, load in loads.items():  # warm: the files are in the page cache
                    gc.collect()
                    t0 = time.perf_counter()
                    load(d)
                    row["loads"][label]["warm"].append(time.perf_counter() - t0)
                for label, load in loads.items():  # cold: evicted first
                    zero_state(model2, opt2)
                    cell = row["loads"][label]
                    cell["evicted"].append(evict(d))
                    t0 = time.perf_counter()
                    load(d)
                    cell["cold"].append(time.perf_counter() - t0)
                    if r == args.repeats - 1:
                        cell["check"] = compare(model, opt, model2, opt2)
            except Exception:
                row["error"] = traceback.format_exc()
                print(f"[{dtype}] {name} FAILED:\n{row['error']}", file=sys.stderr, flush=True)
        # Deleting frees blocks that the filesystem may discard at its next commit: do it
        # between rounds, commit, and let the device settle, not inside someone's fsync.
        for p in work.iterdir():
            shutil.rmtree(p, ignore_errors=True)
        quiesce(max(1.0, args.settle))
        print(f"[{dtype}] round {r + 1}/{args.repeats} done", flush=True)
    del model, opt, model2, opt2, fns
    gc.collect()
    return {"state": desc, "rows": rows}


# -- report --------------------------------------------------------------------------------------


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else math.nan


def summarise(res: dict[str, Any]) -> dict[str, Any]:
    """Medians and derived numbers of one pass (added under ``summary``)."""
    nbytes = res["state"]["bytes"]
    rows = res["rows"]
    out: dict[str, Any] = {}
    disk = rows.get("disk", {}).get("rounds", [])
    if disk:
        b = disk[0]["bytes"]
        direct = [x["direct_write"] for x in disk if x.get("direct_write")]
        dread = [x["direct_read"] for x in disk if x.get("direct_read")]
        out["disk"] = {
            "bytes": b,
            "dd_write_gbs": b / med([x["dd_write"] for x in disk]) / GB,
            "rand_write_gbs": b / med([x["rand_write"] for x in disk]) / GB,
            "dd_read_cold_gbs": b / med([x["dd_read_cold"] for x in disk]) / GB,
            "direct_read_gbs": b / med(dread) / GB if dread else None,
            # the reference for "% disk": the fastest of the three (all write and fsync the
            # same byte count; a virtual disk may treat zeros specially; O_DIRECT streams to the
            # disk while the others first fill the page cache), so the goal is not flattered
            "write_gbs": b
            / min(
                med([x["dd_write"] for x in disk]),
                med([x["rand_write"] for x in disk]),
                *([med(direct)] if direct else []),
            )
            / GB,
            "direct_write_gbs": b / med(direct) / GB if direct else None,
            "direct_spread": _report.spread(direct) if direct else 0.0,
            "dd_spread": _report.spread([x["dd_write"] for x in disk]),
            "rand_spread": _report.spread([x["rand_write"] for x in disk]),
            "evicted_frac": med([x["evicted"] / b for x in disk]),
        }
    for name, row in rows.items():
        if name == "disk" or not row.get("save"):
            continue
        s = {
            "save_s": med(row["save"]),
            "blocking_s": med(row["blocking"]),
            "save_gbs": nbytes / med(row["save"]) / GB,
            "save_spread": _report.spread(row["save"]),
            "file_bytes": row["bytes"],
            "loads": {},
        }
        for label, cell in row["loads"].items():
            if not cell["cold"]:
                continue
            s["loads"][label] = {
                "cold_s": med(cell["cold"]),
                "warm_s": med(cell["warm"]),
                "cold_gbs": nbytes / med(cell["cold"]) / GB,
                "warm_gbs": nbytes / med(cell["warm"]) / GB,
                "cold_spread": _report.spread(cell["cold"]),
                "evicted_frac": med(cell["evicted"]) / max(1, row["bytes"] or 1),
                "check": cell.get("check", "-"),
            }
        out[name] = s
    res["summary"] = out
    return out


LABELS = {
    "ours": "ours",
    "ours-zstd": "ours zstd-{lvl}",
    "ours-async": "ours async",
    "ours-zstd-async": "ours zstd-{lvl} async",
    "torch": "torch.save",
    "safetensors": "safetensors",
    "dcp": "dcp.save",
    "dcp-async": "dcp.async_save",
}
LOAD_LABELS = {
    "ours": "ours load",
    "ours-zstd": "ours zstd-{lvl} load",
    "torch.load": "torch.load",
    "torch.load mmap": "torch.load mmap",
    "safetensors": "safetensors load_file",
    "dcp": "dcp.load",
}


def table(passes: dict[str, dict[str, Any]], main_dtype: str, args: argparse.Namespace) -> str:
    res = passes[main_dtype]
    sm = res["summary"]
    rows = res["rows"]
    nbytes = res["state"]["bytes"]
    disk = sm.get("disk")
    disk_gbs = disk["write_gbs"] if disk else None
    dcp = sm.get("dcp", {})
    dcp_load = dcp.get("loads", {}).get("dcp", {})
    lines = [
        f"state: {nbytes / GB:.3f} GB {main_dtype} (GB = 1e9 B), median of {args.repeats}; "
        "GB/s = state bytes / time; vs DCP = DCP's time / this one's",
        "",
        f"{'save':24} {'file GB':>8} {'save s':>8} {'GB/s':>6} {'% disk':>7} {'vs DCP':>7} "
        f"{'blocking s':>10} {'% sync':>7} {'spread':>7}",
    ]
    if disk:
        b = disk["bytes"]
        for label, key, sp in (
            ("disk dd zeros+fsync", "dd_write_gbs", "dd_spread"),
            ("disk random+fsync", "rand_write_gbs", "rand_spread"),
            ("disk random O_DIRECT", "direct_write_gbs", "direct_spread"),
        ):
            if not disk.get(key):
                continue
            lines.append(
                f"{label:24} {b / GB:8.3f} {b / disk[key] / GB:8.3f} {disk[key]:6.2f} "
                f"{disk[key] / disk_gbs * 100:6.0f}% {'':>7} {'':>10} {'':>7} "
                f"{disk[sp] * 100:6.0f}%"
            )
    for name, row in rows.items():
        if name == "disk":
            continue
        label = LABELS[name].format(lvl=args.zstd_level)
        if "skipped" in row:
            lines.append(f"{label:24} SKIPPED: {row['skipped']}")
            continue
        if name not in sm:
            err = row.get("error", "no result").strip().splitlines()[-1]
            lines.append(f"{label:24} FAILED: {err}")
            continue
        s = sm[name]
        pct = f"{s['save_gbs'] / disk_gbs * 100:6.0f}%" if disk_gbs else f"{'-':>7}"
        sync_of = SYNC_OF.get(name)
        if sync_of:
            ref = sm.get(sync_of, {}).get("save_s")
            blk = f"{s['blocking_s']:10.3f} " + (
                f"{s['blocking_s'] / ref * 100:6.1f}%" if ref else f"{'-':>7}"
            )
        else:
            blk = f"{'':>10} {'':>7}"
        lines.append(
            f"{label:24} {s['file_bytes'] / GB:8.3f} {s['save_s']:8.3f} {s['save_gbs']:6.2f} "
            f"{pct} {_report.ratio(dcp.get('save_s'), s['save_s']):>7} {blk} "
            f"{s['save_spread'] * 100:6.0f}%"
            + ("   (save = until wait() returns)" if sync_of else "")
        )
    lines += [
        "",
        f"{'load':24} {'cold s':>8} {'GB/s':>6} {'vs DCP':>7} {'warm s':>8} {'GB/s':>6} "
        f"{'vs DCP':>7} {'evicted':>8} {'spread':>7}  check",
    ]
    if disk:
        b = disk["bytes"]
        g = disk["dd_read_cold_gbs"]
        lines.append(
            f"{'disk dd read':24} {b / g / GB:8.3f} {g:6.2f} {'':>7} {'':>8} {'':>6} {'':>7} "
            f"{disk['evicted_frac'] * 100:7.0f}%"
        )
        if disk.get("direct_read_gbs"):
            g = disk["direct_read_gbs"]
            lines.append(f"{'disk O_DIRECT 8 threads':24} {b / g / GB:8.3f} {g:6.2f}")
    for name, s in sm.items():
        if name == "disk":
            continue
        for label, c in s["loads"].items():
            shown = LOAD_LABELS.get(label, label).format(lvl=args.zstd_level)
            lines.append(
                f"{shown:24} {c['cold_s']:8.3f} "
                f"{c['cold_gbs']:6.2f} {_report.ratio(dcp_load.get('cold_s'), c['cold_s']):>7} "
                f"{c['warm_s']:8.3f} {c['warm_gbs']:6.2f} "
                f"{_report.ratio(dcp_load.get('warm_s'), c['warm_s']):>7} "
                f"{c['evicted_frac'] * 100:7.0f}% "
                f"{c['cold_spread'] * 100:6.0f}%  {c['check']}"
            )
    # zstd: every pass that has ours-zstd
    zrows = []
    for dt, pr in passes.items():
        zs, plain = pr["summary"].get("ours-zstd"), pr["summary"].get("ours")
        if not zs:
            continue
        b = pr["state"]["bytes"]
        zl = zs["loads"].get("ours-zstd", {})
        pl = (plain or {}).get("loads", {}).get("ours", {})
        zrows.append(
            f"{dt:6} {b / GB:7.3f} {zs['file_bytes'] / GB:8.3f} {b / zs['file_bytes']:6.3f} "
            f"{zs['save_gbs']:9.2f} {plain['save_gbs'] if plain else math.nan:9.2f} "
            f"{zl.get('cold_gbs', math.nan):9.2f} {pl.get('cold_gbs', math.nan):9.2f}"
        )
    lines += [
        "",
        f"zstd level {args.zstd_level} (ours-zstd vs ours plain; GB/s of the uncompressed state):",
        f"{'dtype':6} {'raw GB':>7} {'file GB':>8} {'ratio':>6} {'save zstd':>9} {'save plain':>9} "
        f"{'load zstd':>9} {'load plain':>9}",
    ]
    lines += zrows or ["  (needs ours-zstd in the run)"]
    lines += ["", "goals:"]
    lines += [f"  {g}" for g in goals(passes, main_dtype)]
    notes = []
    for name in rows:
        for label, c in sm.get(name, {}).get("loads", {}).items():
            if c["evicted_frac"] < 0.5:
                notes.append(
                    f"{label}: only {c['evicted_frac'] * 100:.0f}% of its files left the page "
                    "cache before cold loads"
                )
    for name, s in sm.items():
        if name != "disk" and s["save_spread"] > 0.3:
            notes.append(
                f"{name}: save spread {s['save_spread'] * 100:.0f}% (>30%: busy machine or "
                "disk, rerun before quoting)"
            )
    if notes:
        lines += ["", "notes:"] + [f"  {n}" for n in notes]
    return "\n".join(lines)


def goals(passes: dict[str, dict[str, Any]], main_dtype: str) -> list[str]:
    sm = passes[main_dtype]["summary"]
    nbytes = passes[main_dtype]["state"]["bytes"]
    ours, dcp, disk = sm.get("ours"), sm.get("dcp"), sm.get("disk")
    out = []

    def verdict(ok: bool) -> str:
        return "met" if ok else "NOT met"

    if ours and disk:
        pct = ours["save_gbs"] / disk["write_gbs"]
        out.append(
            f"save >= 80% of disk bandwidth: ours {ours['save_gbs']:.2f} GB/s = {pct * 100:.0f}% "
            f"of the disk's {disk['write_gbs']:.2f} GB/s (dd zeros {disk['dd_write_gbs']:.2f}, "
            f"random {disk['rand_write_gbs']:.2f}"
            + (f", O_DIRECT {disk['direct_write_gbs']:.2f}" if disk.get("direct_write_gbs") else "")
            + f"): {verdict(pct >= 0.8)}"
        )
    else:
        out.append("save >= 80% of disk bandwidth: needs ours and disk")
    if ours and dcp:
        x = dcp["save_s"] / ours["save_s"]
        out.append(
            f"save >= 1.5x DCP: {ours['save_s']:.3f} s vs {dcp['save_s']:.3f} s = {x:.2f}x: "
            f"{verdict(x >= 1.5)}"
        )
        ol, dl = ours["loads"].get("ours"), dcp["loads"].get("dcp")
        if ol and dl:
            xc, xw = dl["cold_s"] / ol["cold_s"], dl["warm_s"] / ol["warm_s"]
            out.append(
                f"load >= 2x DCP: cold (evicted) {ol['cold_s']:.3f} s vs {dl['cold_s']:.3f} s = "
                f"{xc:.2f}x: {verdict(xc >= 2)}; warm (page cache) {xw:.2f}x: {verdict(xw >= 2)}"
            )
            if disk:
                best = max(disk["dd_read_cold_gbs"], disk.get("direct_read_gbs") or 0.0)
                need = 2 * nbytes / dl["cold_s"] / GB
                got = nbytes / ol["cold_s"] / GB
                out.append(
                    f"  cold load ceiling: the disk reads at most {best:.2f} GB/s (dd "
                    f"{disk['dd_read_cold_gbs']:.2f}, O_DIRECT 8 threads "
                    f"{disk.get('direct_read_gbs') or 0:.2f}); ours {got:.2f} GB/s = "
                    f"{got / best:.0%} of it; 2x DCP needs {need:.2f} GB/s"
                )
    else:
        out.append("save >= 1.5x DCP, load >= 2x DCP: need ours and dcp")
    for a, sync in (("ours-async", "ours"), ("ours-zstd-async", "ours-zstd")):
        if a in sm and sync in sm:
            f = sm[a]["blocking_s"] / sm[sync]["save_s"]
            out.append(
                f"async save blocks <= 10% of a sync save: {a} {sm[a]['blocking_s']:.3f} s = "
                f"{f * 100:.1f}% of {sync} {sm[sync]['save_s']:.3f} s: {verdict(f <= 0.10)}"
            )
    if not any(a in sm for a in ("ours-async", "ours-zstd-async")):
        out.append("async save blocks <= 10% of a sync save: needs ours-async and ours")
    have = [
        f"{dt} ratio {pr['state']['bytes'] / pr['summary']['ours-zstd']['file_bytes']:.3f} at "
        f"{pr['summary']['ours-zstd']['save_gbs']:.2f} GB/s"
        for dt, pr in passes.items()
        if "ours-zstd" in pr["summary"]
    ]
    dts = {pr["state"]["dtype"] for pr in passes.values() if "ours-zstd" in pr["summary"]}
    out.append(
        "zstd ratio and speed for fp32 and bf16 weights: "
        + ("; ".join(have) if have else "none")
        + (": reported" if {"fp32", "bf16"} <= dts else ": NOT all reported")
    )
    return out


def plot(passes: dict[str, dict[str, Any]], main_dtype: str, path: Path, lvl: int) -> str:
    sm = passes[main_dtype]["summary"]
    disk = sm.get("disk")
    saves = [(LABELS[n].format(lvl=lvl), s["save_gbs"]) for n, s in sm.items() if n != "disk"]
    loads = [
        (LOAD_LABELS.get(lab, lab).format(lvl=lvl), c["cold_gbs"], c["warm_gbs"])
        for n, s in sm.items()
        if n != "disk"
        for lab, c in s["loads"].items()
    ]
    gb = passes[main_dtype]["state"]["bytes"] / GB

    def draw(plt: Any) -> Any:
        fig, axes = plt.subplots(1, 2, figsize=(12, 4))
        if saves:
            axes[0].bar([s[0] for s in saves], [s[1] for s in saves], color="tab:blue")
        if loads:
            xs = range(len(loads))
            axes[1].bar([x - 0.2 for x in xs], [c[1] for c in loads], 0.4, label="cold (evicted)")
            axes[1].bar(
                [x + 0.2 for x in xs], [c[2] for c in loads], 0.4, label="warm (page cache)"
            )
            axes[1].set_xticks(list(xs), [c[0] for c in loads])
        if disk:
            write = disk["write_gbs"]
            axes[0].axhline(write, color="grey", lw=1, ls="--", label="disk write+fsync")
            axes[0].axhline(0.8 * write, color="red", lw=1, ls=":", label="80% goal")
            axes[1].axhline(
                disk["dd_read_cold_gbs"], color="grey", lw=1, ls="--", label="dd read (evicted)"
            )
        for ax in axes:
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=8)
        for ax, title in zip(axes, ("save GB/s (incl. fsync)", "load GB/s"), strict=True):
            ax.set_title(title)
            ax.tick_params(axis="x", labelrotation=35, labelsize=8)
        fig.suptitle(f"checkpoint of {gb:.2f} GB ({main_dtype} TinyGPT + AdamW), one process")
        return fig

    return _report.plot(path, draw)


def machine(work: Path) -> str:
    """The machine line (with its RAM), safetensors and shardline, and where ``work`` is."""
    try:
        import safetensors  # noqa: PLC0415

        st = safetensors.__version__
    except ImportError:
        st = "-"
    import shardline  # noqa: PLC0415

    dev, fs = "?", "?"
    best = ""
    with open("/proc/mounts") as f:
        for line in f:
            src, mnt, typ = line.split()[:3]
            if str(work).startswith(mnt) and len(mnt) >= len(best):
                best, dev, fs = mnt, src, typ
    return (
        f"{_report.machine(ram=True)}, safetensors {st}, shardline "
        f"{getattr(shardline, '__version__', '?')}; files on {dev} ({fs}, mounted at {best})"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gb", type=float, default=1.0, help="state size, 10^9 bytes (default 1.0)")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    zstd_help = "dtypes to report zstd on; others than --dtype get an ours/ours-zstd pass"
    _harness.add_subset(p, "--zstd-dtypes", ("fp32", "bf16"), zstd_help)
    _harness.add_subset(p, "--impls", IMPLS)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--zstd-level", type=int, default=3)
    p.add_argument(
        "--settle", type=float, default=0.5, help="seconds idle after os.sync() before each write"
    )
    p.add_argument(
        "--dir", default=str(_harness.ROOT / ".bench-tmp"), help="where files go (removed)"
    )
    p.add_argument("--tag", default=None, help="results file name suffix")
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    warnings.filterwarnings("ignore", message=".*assuming the intent is to.*")

    import torch  # noqa: PLC0415

    base = Path(args.dir).resolve()
    created = not base.exists()
    work = base / f"bench-checkpoint-{os.getpid()}"
    work.mkdir(parents=True)
    passes: dict[str, dict[str, Any]] = {}
    try:
        passes[args.dtype] = run_pass(args.dtype, args.impls, args, work)
        summarise(passes[args.dtype])
        extra = [i for i in ("ours", "ours-zstd") if i in args.impls]
        zrow = passes[args.dtype]["rows"].get("ours-zstd", {})
        if "ours-zstd" in extra and "skipped" not in zrow and "error" not in zrow:
            for dt in args.zstd_dtypes:
                if dt != args.dtype:
                    passes[dt] = run_pass(dt, extra, args, work)
                    summarise(passes[dt])
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if created:
            shutil.rmtree(base, ignore_errors=True)
    cores = os.cpu_count()
    default_tag = f"cpu-{cores}c" + ("" if args.gb == 1.0 else f"-{args.gb:g}gb")
    tag = args.tag or default_tag + ("" if args.dtype == "fp32" else f"-{args.dtype}")
    head = _report.header(Path(__file__).name, machine(work), argv)
    _report.publish(
        _report.RESULTS / f"checkpoint-{tag}",
        head,
        table(passes, args.dtype, args),
        {
            "args": vars(args),
            "machine": head.splitlines()[1][2:],
            "torch": torch.__version__,
            "cores": cores,
            "passes": passes,
            "goals": goals(passes, args.dtype),
        },
        lambda path: plot(passes, args.dtype, path, args.zstd_level),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
