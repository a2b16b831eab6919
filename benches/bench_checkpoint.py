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
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _harness
import _report
from _checkpoint_disk import (
    BLOCK,
    dir_bytes,
    disk_round,
    evict,
    fsync_path,
    quiesce,
)
from _checkpoint_report import GB, goals, plot, summarise, table

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
