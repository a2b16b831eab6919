"""Runs a benchmark's ranks as local processes, and gives each rank its job.

Parent side: ``launch`` starts one command as ranks ``0..world-1`` (torchrun's environment,
free ports, a fresh job secret), enforces a deadline, stops the others when one fails and
reports every rank's stderr, through the launcher the tests use (``launcher()``:
``tests/multiprocess/_launch.py``). ``run_bench`` serves the benches whose ranks are the bench
itself: it parses the command line (built with the ``add_*`` helpers), runs the worker in a
rank, and in the parent runs each world size in turn (every rank gets ``--worker --out PATH``
and the parent's arguments) and returns rank 0's JSON per world size. Worker side:
``join_job`` builds our group and torch's, ``leave_job`` hands the result back and closes
both, ``sync`` waits for the device.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import secrets
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
GRACE_S = 10.0  # how long the other ranks may take to end after one failed
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


class RanksFailed(RuntimeError):
    """Ranks of one world size failed or ran out of time; the message holds every rank's stderr."""


# -- command line ------------------------------------------------------------------------------


def float_options(text: str) -> dict[str, float]:
    """``"a=1,b=2.5"`` as ``{"a": 1.0, "b": 2.5}`` (the ``--*-kw`` options of the benches)."""
    return {k: float(v) for k, v in (kv.split("=") for kv in text.split(","))}


def comma_list(text: str) -> list[str]:
    """``"a, b,,c"`` as ``["a", "b", "c"]``."""
    return [s.strip() for s in text.split(",") if s.strip()]


def parse_size(text: str) -> int:
    """``"4K"``, ``"4KiB"``, ``"64MB"``, ``"1G"``, ``"4096"`` -> bytes (binary units)."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"bad size {text!r}; use e.g. 4K, 64KiB, 1M, 256MiB")
    value = int(m.group(1)) * _UNITS[m.group(2).upper()]
    if value < 4:
        raise argparse.ArgumentTypeError(f"size {text!r} is smaller than one float32")
    return value


class _Subset(argparse.Action):
    """``a,b`` as ``["a", "b"]``; a name outside ``const`` (the choices) is a usage error."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        given = comma_list(str(values))
        unknown = ", ".join(sorted(set(given) - set(self.const)))
        if unknown:
            parser.error(f"{option_string}: unknown {unknown}; choose from {', '.join(self.const)}")
        setattr(namespace, self.dest, given)


def add_subset(
    parser: argparse.ArgumentParser, flag: str, choices: Sequence[str], help: str | None = None
) -> None:
    """``flag a,b``: a subset of ``choices`` (all of them by default), checked as it is parsed."""
    text = help or f"comma-separated subset of {','.join(choices)} (default: all)"
    parser.add_argument(
        flag, action=_Subset, const=tuple(choices), default=list(choices), help=text
    )


def add_kw(parser: argparse.ArgumentParser, flag: str, help: str) -> None:
    """``flag a=1,b=2``: keyword options for a wrapper (``float_options``)."""
    parser.add_argument(flag, type=float_options, default={}, help=help)


def add_blocks(
    parser: argparse.ArgumentParser,
    *,
    steps: int,
    repeats: int,
    warmup: int,
    repeats_help: str | None = None,
) -> None:
    """``--steps``, ``--repeats`` and ``--warmup`` of the benches that time blocks of steps."""
    parser.add_argument("--steps", type=int, default=steps, help="steps per timed block")
    parser.add_argument("--repeats", type=int, default=repeats, help=repeats_help)
    parser.add_argument("--warmup", type=int, default=warmup)


def add_launch(
    parser: argparse.ArgumentParser, *, timeout: float, timeout_help: str | None = None
) -> None:
    """``--timeout`` and ``--tag`` of the benches ``run_worlds`` starts, and the hidden
    ``--worker`` and ``--out`` by which it starts their ranks."""
    parser.add_argument("--timeout", type=float, default=timeout, help=timeout_help)
    parser.add_argument("--tag", default=None, help="results file name suffix")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)


# -- parent: ranks as processes -----------------------------------------------------------------


def rank_env(world: int, *, omp_threads: int | None = None) -> dict[str, str]:
    """The environment every rank of a ``world``-rank job on this host starts from.

    ``os.environ`` plus ``TORCH_PORT`` for torch's store (``launch`` adds torchrun's variables,
    ``MASTER_PORT`` for our group's store), a fresh ``SHARDLINE_SECRET``, this checkout's
    ``python/`` first on ``PYTHONPATH``, unbuffered output and ``OMP_NUM_THREADS`` =
    ``omp_threads`` (default: the cores shared out over the ranks). ``SHARDLINE_HOST_ID`` is
    dropped: every rank is on this host.
    """
    from shardline.launch import free_port  # noqa: PLC0415

    env = dict(os.environ)
    env.pop("SHARDLINE_HOST_ID", None)
    paths = [str(ROOT / "python"), env.get("PYTHONPATH", "")]
    threads = omp_threads or max(1, (os.cpu_count() or 1) // world)
    env.update(
        PYTHONPATH=os.pathsep.join(p for p in paths if p),
        PYTHONUNBUFFERED="1",
        TORCH_PORT=str(free_port()),
        SHARDLINE_SECRET=secrets.token_hex(16),
        OMP_NUM_THREADS=str(threads),
    )
    return env


def _tests_module(name: str) -> Any:
    if str(ROOT) not in sys.path:
        sys.path.append(str(ROOT))
    return importlib.import_module(f"tests.multiprocess.{name}")


def launcher() -> Any:
    """The process launcher the tests use too (``tests/multiprocess/_launch.py``)."""
    return _tests_module("_launch")


def simulated_hosts() -> Any:
    """The simulated hosts the tests use too (``tests/multiprocess/_netns.py``)."""
    return _tests_module("_netns")


def launch(
    args: list[str],
    world: int,
    tmp: Path,
    *,
    timeout: float,
    omp_threads: int | None = None,
    quiet: bool = False,
) -> list[str]:
    """Runs ``python *args`` as every rank of a ``world``-rank job and waits for all of them.

    Each rank is a fresh interpreter leading a session of its own; its stderr goes to a file
    under ``tmp``, its stdout to the terminal (with ``quiet``, rank 0's only: the others' to
    files under ``tmp``). When a rank fails the others get ``GRACE_S`` seconds to end; after
    that, or after ``timeout`` seconds, every rank still running is killed with its session.

    Returns:
        The end of each rank's stderr ("" where it wrote none), when every rank exited 0.

    Raises:
        RanksFailed: A rank failed or the job ran out of time; the message says which and holds
            the end of every rank's stderr.
    """
    procs = launcher()
    errs = [tmp / f"n{world}-rank{r}.stderr" for r in range(world)]

    def output(r: int) -> tuple[Path | None, Path]:
        return (tmp / f"n{world}-rank{r}.stdout" if quiet and r else None), errs[r]

    ranks = procs.start(
        world,
        args=args,
        base=rank_env(world, omp_threads=omp_threads),
        fresh=True,
        output=output,
        new_session=True,
    )
    try:
        procs.finish(ranks, timeout, grace=GRACE_S)
        why = ", ".join(f"rank {r.rank} exited with {r.rc}" for r in ranks if r.rc and not r.killed)
        killed = [str(r.rank) for r in ranks if r.killed]
        if killed:
            why += f"; killed rank(s) {', '.join(killed)}, still running"
    except procs.RanksFailed:
        why = f"timed out after {timeout:.0f} s (--timeout)"
    if why:
        lines = [f"world size {world}: {why}; every rank's stderr follows"]
        for r in range(world):
            lines += [f"----- rank {r} stderr -----", _tail(errs[r])]
        raise RanksFailed("\n".join(lines))
    return [_tail(e, 1500) if e.stat().st_size else "" for e in errs]


def _tail(path: Path, limit: int = 6000) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no output)"
    return text if len(text) <= limit else "...\n" + text[-limit:]


def run_bench(
    parser: argparse.ArgumentParser,
    argv: Sequence[str] | None,
    script: str,
    worker: Callable[[argparse.Namespace], int],
    progress: Callable[[argparse.Namespace, int, dict[str, Any], float], str],
) -> tuple[argparse.Namespace, dict[int, dict[str, Any]]]:
    """Parses the command line of a bench whose ranks are the bench itself (``add_launch``).

    In a rank (``--worker``) it runs ``worker`` and exits with its status. In the parent it runs
    every world size (``run_worlds``, printing ``progress(args, ...)`` after each) and returns
    the arguments and rank 0's result per world size.
    """
    args = parser.parse_args(argv)
    if args.worker:
        raise SystemExit(worker(args))
    return args, run_worlds(script, args, lambda *done: progress(args, *done))


def run_worlds(
    script: str, args: argparse.Namespace, progress: Callable[[int, dict[str, Any], float], str]
) -> dict[int, dict[str, Any]]:
    """Runs ``script``'s worker at each world size of ``args.ranks`` in turn, within
    ``args.timeout`` seconds each; returns rank 0's result per world size.

    The ranks run ``script --worker --out PATH`` followed by the parent's own arguments, so they
    parse what the parent parsed; rank 0 writes its result to ``PATH`` (``leave_job``). After
    each world size it prints ``progress(world, result, seconds it took)``. A failed world ends
    the run (``SystemExit`` with every rank's stderr).
    """
    results: dict[int, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for world in args.ranks:
            t0 = time.monotonic()
            out = Path(tmp) / f"result-n{world}.json"
            cmd = [str(Path(script).resolve()), "--worker", "--out", str(out)]
            try:
                launch([*cmd, *sys.argv[1:]], world, Path(tmp), timeout=args.timeout)
            except RanksFailed as exc:
                raise SystemExit(str(exc)) from None
            if not out.exists():
                raise SystemExit(f"world size {world}: workers exited 0 but wrote no result")
            results[world] = json.loads(out.read_text())
            print(progress(world, results[world], time.monotonic() - t0), flush=True)
    return results


# -- worker: the job of one rank ----------------------------------------------------------------


def join_job(device_kind: str) -> tuple[int, int, Any, Any]:
    """In a worker: this rank's device, our group (native or NCCL) and torch's default group
    (Gloo or NCCL) on its own store; returns ``(rank, world, device, our group)``."""
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    import shardline as sl  # noqa: PLC0415

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cuda = device_kind == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    ours = sl.init(backend="nccl" if cuda else "native")
    store = dist.TCPStore(
        "127.0.0.1", int(os.environ["TORCH_PORT"]), world, rank == 0, timedelta(seconds=120)
    )
    dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=rank, world_size=world)
    return rank, world, device, ours


def leave_job(rank: int, result: Any = None, out: str | None = None) -> int:
    """In a worker: rank 0 writes ``result`` as JSON to ``out`` (where ``run_worlds`` reads it),
    then torch's group and ours close. Returns 0, the worker's exit status."""
    import torch.distributed as dist  # noqa: PLC0415

    import shardline as sl  # noqa: PLC0415

    if rank == 0 and out is not None:
        Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()
    sl.shutdown()
    return 0


def sync(device: Any) -> None:
    """Waits for ``device``'s queued work (CUDA); nothing to wait for on the CPU."""
    if device.type == "cuda":
        import torch  # noqa: PLC0415

        torch.cuda.synchronize()


def alternate(
    steps: Mapping[str, Callable[[], Any]],
    args: argparse.Namespace,
    device: Any,
    after: Callable[[str], None] | None = None,
) -> tuple[dict[str, list[float]], dict[str, int]]:
    """In a worker: times the sides of a comparison in alternating blocks.

    Each side runs ``args.warmup`` steps first; then ``args.repeats`` rounds, each a block of
    ``args.steps`` steps per side, sides in turn, with a barrier and a device sync around every
    block (so drift in the machine's speed hits every side alike). ``after(name)`` runs after
    each timed step. Returns each side's seconds per step, one value per block, and on CUDA
    the most bytes allocated during its blocks (0 on the CPU).
    """
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    for fn in steps.values():
        for _ in range(args.warmup):
            fn()
    times: dict[str, list[float]] = {k: [] for k in steps}
    peak = dict.fromkeys(steps, 0)
    for _ in range(args.repeats):
        for name, fn in steps.items():
            dist.barrier()
            sync(device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            t0 = time.perf_counter()
            for _ in range(args.steps):
                fn()
                if after is not None:
                    after(name)
            sync(device)
            times[name].append((time.perf_counter() - t0) / args.steps)
            if device.type == "cuda":
                peak[name] = max(peak[name], torch.cuda.max_memory_allocated(device))
    return times, peak
