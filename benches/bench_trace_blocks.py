"""What tracing costs one process's ZeRO-3 steps, traced and untraced steps side by side.

Separate runs of a short GPU job drift by more than the 1 % being measured (a run's step time
moved 25-39 ms on an H200 between runs of the same command), and so do blocks of steps
within one run (±15 % from one 60-step block to the next). Here one process (world size 1)
trains ``bench_zero.py``'s GPT under ZeRO-3 with the tracer running, and by default
(``--mode steps``) records every other step's ops and not the ones between: each traced
step is timed against the untraced step beside it (a synchronize ends each step), the order
inside a pair alternating. What tracing costs the program's thread and the GPU is the traced
steps' total time over the untraced steps' (with its standard error, from the pairs'
differences); the median of the pairs' ratios and their mean are printed beside it. The mean
of ratios reads high: each ratio divides by a step that itself varies (±15 % on an H200
host), and the mean of ``a / b`` exceeds ``mean(a) / mean(b)`` by about the steps' relative
variance times one minus the pairs' correlation (0.3-0.8 % here, more than the cost being
measured). The tracer's own thread does its work meanwhile for the traced
steps' ops; its CPU time per traced step with the GIL held is added on top, as if the program
waited for all of it (an upper bound where the host's launching bounds the step, as here;
it reads events through the driver, and writes its files in system calls, with the GIL
released, on another core: their time is taken out, by the thread's own clock and by its
``getrusage`` split into user and kernel time around each write, and the total with it is
printed too). The program's main thread's CPU per step is printed for both sides, and how
many program lines were walked on the steps that repeat the walked step's.
``--mode blocks`` starts and stops the tracer between alternated blocks of ``--steps`` steps
instead (the way it was measured before; the blocks drift more than the cost).
``--no-gpu-times`` traces without the NCCL ops' GPU times; ``--gpu-every N`` takes them on one
traced step in N, as ``SHARDLINE_TRACE_GPU=N`` does (the pairs' median alone would miss a cost
paid on one step in N: the pairs with and without GPU times are taken apart, their medians
weighted 1 to N - 1); ``--torch-events`` takes them through torch's events, one Python call
each, instead of the driver's. As the tracer does, the ops' program lines are walked on the
steps that take GPU times (on one in 16 without them) and repeated on the others.

    python benches/bench_trace_blocks.py --device cuda --pairs 400   # medium GPT, bf16
    python benches/bench_trace_blocks.py --device cpu --size small --dtype fp32

Writes ``benches/results/trace-blocks-<tag>.{txt,json}``.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _report
import torch
from bench_zero import SIZES

import shardline as sl
from shardline.comm import program_line
from shardline.comm.flight import RECORDER
from shardline.comm.trace import device as device_times
from shardline.comm.trace import folder, recorder
from shardline.comm.trace.recorder import TRACER
from shardline.examples.train import Config, TinyGPT


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    p.add_argument("--size", default="medium", choices=list(SIZES))
    p.add_argument("--dtype", default="bf16", choices=["fp32", "bf16"])
    p.add_argument("--mode", default="steps", choices=["steps", "blocks"])
    p.add_argument("--pairs", type=int, default=300, help="pairs of steps (--mode steps)")
    p.add_argument("--blocks", type=int, default=8, help="blocks per side (--mode blocks)")
    p.add_argument(
        "--steps", type=int, default=100,
        help="steps per block (--mode blocks; longer than the tracer's 1 s interval)",
    )  # fmt: skip
    p.add_argument(
        "--no-gpu-times", action="store_true",
        help="trace without the NCCL ops' GPU times (host times only)",
    )  # fmt: skip
    p.add_argument(
        "--gpu-every", type=int, default=1,
        help="GPU times on one traced step in N (SHARDLINE_TRACE_GPU=N; --mode steps)",
    )  # fmt: skip
    p.add_argument(
        "--torch-events", action="store_true",
        help="GPU times through torch's events, one call each (the way before the driver's)",
    )  # fmt: skip
    p.add_argument(
        "--lines-every", type=int, default=None,
        help="walk the ops' program lines on one traced step in N (default: as the tracer "
        "does, on the steps with GPU times, one in 16 without them; 1: every step, as before "
        "the steps between repeated them; --mode steps)",
    )  # fmt: skip
    p.add_argument("--tag", default=None)
    args = p.parse_args(argv)
    if args.torch_events:
        device_times.use_events(device_times.TORCH)
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29533"}.items():  # fmt: skip
        os.environ.setdefault(k, v)
    os.environ.pop("SHARDLINE_TRACE", None)  # the bench says when it traces
    cuda = args.device == "cuda"
    group = sl.init(backend="nccl" if cuda else "native")
    d_model, layers, heads, seq_len, batch = SIZES[args.size]
    cfg = Config(d_model=d_model, num_layers=layers, num_heads=heads, seq_len=seq_len)
    torch.manual_seed(0)
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    model = TinyGPT(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    precision = {}
    if args.dtype == "bf16":
        precision["mixed_precision"] = sl.MixedPrecision(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    model, opt = sl.distribute(model, opt, strategy="zero3", **precision)
    assert opt is not None
    x = torch.randint(0, cfg.vocab, (batch, seq_len), device=device)
    y = torch.randint(0, cfg.vocab, (batch, seq_len), device=device)

    def steps(n: int) -> None:
        for _ in range(n):
            opt.zero_grad(set_to_none=True)
            model(x, y).backward()
            opt.step()

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def start(directory: str) -> None:
        TRACER.start(directory, rank=0, world_size=1, backend=group.backend)
        if args.no_gpu_times:  # the tracer as it was before it read GPU times
            RECORDER.device_sink = None

    how = (
        "no GPU" if not cuda
        else "host times only" if args.no_gpu_times
        else "GPU times through torch's events" if args.torch_events
        else f"GPU times through {type(device_times.events()).__name__.strip('_')}"
    ) + (f", on one traced step in {args.gpu_every}" if cuda and args.gpu_every > 1
         and not args.no_gpu_times else "") + (
        f"; program lines walked on one traced step in {args.lines_every}"
        if args.lines_every else "")  # fmt: skip
    what = f"zero3, 1 process, {args.device}, {args.size} GPT {args.dtype}"
    steps(5)  # warm-up
    with tempfile.TemporaryDirectory() as tmp:
        run = _paired_steps if args.mode == "steps" else _blocks
        lines, doc = run(args, _Job(steps, sync, start, f"{tmp}/t"))
        ops = folder.load(f"{tmp}/t")[0].ops
    sl.shutdown()
    on_gpu = sum(1 for o in ops if folder.device_span(o) is not None)
    lines[0] = f"{what}, {lines[0]}; {how}"
    lines.append(f"{len(ops)} ops written, {on_gpu} with GPU times")
    tag = args.tag or f"{args.device}-{args.size}-{args.dtype}"
    _report.publish(
        _report.RESULTS / f"trace-blocks-{tag}",
        _report.header(Path(__file__).name, _report.machine(args.device)),
        "\n".join(lines),
        {"args": vars(args), **doc},
        lambda _path: "no plot: a few numbers",
    )
    return 0


class _Job(NamedTuple):
    """What both modes run: steps, the wait for the device, and the tracer's start."""

    steps: Callable[[int], None]
    sync: Callable[[], None]
    start: Callable[[str], None]
    directory: str


def _tracer_cpu() -> float:
    """CPU seconds the tracer's thread has used so far (0 when it runs none)."""
    thread = TRACER._thread
    if thread is None or thread.ident is None:
        return 0.0
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


class _Walks:
    """Counts the program lines walked, on the steps that walk them and on those between."""

    def __init__(self) -> None:
        self.fresh = self.repeat = 0
        self._real = real = program_line.callsite

        def counted(frame: Any = None, skip: int = 0) -> str | None:
            if program_line.LINES.fresh:
                self.fresh += 1
            else:
                self.repeat += 1
            return real(frame, skip + 1)

        program_line.callsite = counted  # type: ignore[assignment]

    def close(self) -> None:
        program_line.callsite = self._real  # type: ignore[assignment]


class _WriteClock:
    """The tracer's thread's CPU in its writes, in the program (user) and in the kernel.

    The kernel's part is the system calls that write the files, which Python makes with the
    GIL released; the user part holds the GIL but for the reading of events through the
    driver. ``getrusage`` of the calling thread, around each write the tracer's thread makes.
    """

    def __init__(self) -> None:
        self.user = self.system = 0.0
        self._real = TRACER.flush

        def flush(state: str = "running") -> None:
            if threading.current_thread() is not TRACER._thread:
                self._real(state)
                return
            a = resource.getrusage(resource.RUSAGE_THREAD)
            self._real(state)
            b = resource.getrusage(resource.RUSAGE_THREAD)
            self.user += b.ru_utime - a.ru_utime
            self.system += b.ru_stime - a.ru_stime

        TRACER.flush = flush  # type: ignore[method-assign]

    def close(self) -> None:
        del TRACER.flush  # the method again


def _paired_steps(args: argparse.Namespace, job: _Job) -> tuple[list[str], dict[str, Any]]:
    """Steps alternately recorded and not, the tracer running throughout (``--mode steps``)."""
    steps, sync = job.steps, job.sync
    job.start(job.directory)
    sinks = (RECORDER.sink, RECORDER.device_sink)

    every = max(args.gpu_every, 1)
    # The ops' program lines are walked on the sampled steps (on one in LINES_EVERY without
    # GPU times) and repeated on the others, as the tracer does.
    lines_every = args.lines_every or (recorder.LINES_EVERY if args.no_gpu_times else every)
    traced_steps = [0]
    on_gpu: list[bool] = []  # whether each traced step took GPU times

    main_cpu: dict[bool, list[float]] = {True: [], False: []}  # the program thread's, per step

    def one(traced: bool) -> float:
        # As the tracer samples (SHARDLINE_TRACE_GPU=N), over the traced steps only.
        if traced:
            gpu = sinks[1] if traced_steps[0] % every == 0 else None
            RECORDER.sink, RECORDER.device_sink = sinks[0], gpu
            program_line.LINES.set_fresh(traced_steps[0] % lines_every == 0)
            traced_steps[0] += 1
            on_gpu.append(gpu is not None)
        else:
            RECORDER.sink, RECORDER.device_sink = None, None
            program_line.LINES.set_fresh(False)
        sync()
        t, cpu = time.perf_counter(), time.thread_time()
        steps(1)
        main_cpu[traced].append((time.thread_time() - cpu) * 1e3)
        sync()
        return (time.perf_counter() - t) * 1e3

    for i in range(10):  # warm-up, both ways
        one(i % 2 == 0)
    on_gpu.clear()
    main_cpu[True].clear()
    main_cpu[False].clear()
    on: list[float] = []
    off: list[float] = []
    clock = _WriteClock()
    walks = _Walks()
    cpu0, read0 = _tracer_cpu(), TRACER.device.reading_s
    for i in range(args.pairs):
        first = i % 2 == 0  # which side goes first alternates
        a, b = one(first), one(not first)
        on.append(a if first else b)
        off.append(b if first else a)
    tracer_ms = (_tracer_cpu() - cpu0) * 1e3 / args.pairs
    # Of which reading events through the driver, with the GIL released (another core's), and
    # in the kernel, writing the files (the system calls release the GIL).
    reading_ms = (TRACER.device.reading_s - read0) * 1e3 / args.pairs
    kernel_ms = clock.system * 1e3 / args.pairs
    user_ms = clock.user * 1e3 / args.pairs
    held_ms = max(tracer_ms - kernel_ms - reading_ms, 0.0)
    clock.close()
    walks.close()
    RECORDER.sink, RECORDER.device_sink = sinks
    TRACER.stop()
    # The program's main thread's CPU per step, traced against untraced beside it.
    cpu_ratios = [a / b - 1 for a, b in zip(main_cpu[True], main_cpu[False], strict=True)]
    ratios = [a / b - 1 for a, b in zip(on, off, strict=True)]
    paired = statistics.median(ratios)
    # What many steps cost together: the traced steps' total time over the untraced steps'.
    # The median alone would miss a cost paid on one step in N (GPU times sampled); the mean
    # of the ratios leans high (the module's doc). Its standard error, as a ratio of means':
    # from each pair's difference to the ratio's prediction.
    total, total_se = _ratio_of_totals(on, off)
    mean = statistics.fmean(ratios)
    sem = statistics.stdev(ratios) / len(ratios) ** 0.5
    base = statistics.median(off)
    # The tracer's thread, with the GIL and with all of its CPU, of a mean untraced step.
    held, all_cpu = held_ms / statistics.fmean(off), tracer_ms / statistics.fmean(off)
    q1, _, q3 = statistics.quantiles(ratios, n=4)
    sampled = ""
    split: dict[str, float] = {}
    if args.device == "cuda" and 1 < every <= len(ratios):
        # A robust mean when one traced step in N takes GPU times: the median of those steps'
        # pairs and of the others', weighted 1 to N - 1.
        timed = [r for r, g in zip(ratios, on_gpu, strict=True) if g]
        host = [r for r, g in zip(ratios, on_gpu, strict=True) if not g]
        split = {"gpu_pairs": statistics.median(timed), "host_pairs": statistics.median(host)}
        split["weighted"] = (split["gpu_pairs"] + (every - 1) * split["host_pairs"]) / every
        sampled = (
            f"the pairs split: {len(timed)} with GPU times, median {split['gpu_pairs']:+.2%}; "
            f"{len(host)} without, median {split['host_pairs']:+.2%}; weighted 1 to {every - 1}: "
            f"{split['weighted']:+.2%}, plus the tracer's thread with the GIL: "
            f"{split['weighted'] + held_ms / base:+.2%}"
        )
    lines = [
        f"{args.pairs} pairs of steps, one recorded and one not, order alternated",
        f"untraced: {base:.2f} ms/step, traced: {statistics.median(on):.2f} ms/step (medians)",
        f"the traced steps' total time over the untraced steps': {total:+.2%} (standard "
        f"error {total_se:.2%})",
        f"the pairs' ratios (traced / untraced - 1): median {paired:+.2%}, quartiles "
        f"{q1:+.2%} and {q3:+.2%}; mean {mean:+.2%} (standard error {sem:.2%}; a mean of "
        f"ratios leans high: the module's doc)",
        f"the tracer's thread: {tracer_ms:.3f} ms of CPU per traced step ({user_ms:.3f} ms "
        f"in its writes' own code, {kernel_ms:.3f} ms in their system calls); without the "
        f"GIL: the system calls and {reading_ms:.3f} ms reading events; with it: "
        f"{held_ms:.3f} ms, {held_ms / base:+.2%} of the untraced step",
        f"the program's main thread: {statistics.median(main_cpu[True]):.2f} ms of CPU per "
        f"traced step, {statistics.median(main_cpu[False]):.2f} untraced (medians); the "
        f"pairs' median {statistics.median(cpu_ratios):+.2%}",
        f"program lines walked: {walks.fresh} on the steps that walk them, {walks.repeat} on "
        f"the steps between (ops that did not repeat the walked step's)",
        f"overhead: {total + held:+.2%} ± {total_se:.2%} (the total time's plus the tracer's "
        f"thread with the GIL; bar 1 %); with all of its CPU "
        f"{total + all_cpu:+.2%}",
        f"overhead by the pairs' median: {paired + held_ms / base:+.2%}; by their mean "
        f"{mean + held_ms / base:+.2%} (each plus the tracer's thread with the GIL)",
        *([sampled] if sampled else []),
    ]
    doc = {"on": on, "off": off, "tracer_ms": tracer_ms, "reading_ms": reading_ms,
           "tracer_kernel_ms": kernel_ms, "tracer_user_ms": user_ms,
           "main_cpu_on": main_cpu[True], "main_cpu_off": main_cpu[False],
           "walked_fresh": walks.fresh, "walked_between": walks.repeat,
           "total": total, "total_se": total_se, "overhead_total": total + held,
           "paired": paired, "mean": mean, "sem": sem, "overhead": paired + held_ms / base,
           "overhead_mean": mean + held_ms / base, **split,
           "overhead_all_tracer_cpu": total + all_cpu}  # fmt: skip
    return lines, doc


def _ratio_of_totals(on: list[float], off: list[float]) -> tuple[float, float]:
    """``sum(on) / sum(off) - 1`` and its standard error, ``on[i]`` paired with ``off[i]``.

    The error of a ratio of means (to first order): the spread of each pair's ``on - r * off``
    over ``sqrt(n)`` and the mean of ``off``.
    """
    r = sum(on) / sum(off)
    residuals = [a - r * b for a, b in zip(on, off, strict=True)]
    se = statistics.stdev(residuals) / len(on) ** 0.5 / statistics.fmean(off)
    return r - 1, se


def _blocks(args: argparse.Namespace, job: _Job) -> tuple[list[str], dict[str, Any]]:
    """The tracer started and stopped between alternated blocks of steps (``--mode blocks``)."""
    steps, sync = job.steps, job.sync

    def block(n: int, traced: bool) -> tuple[float, float, float]:
        """ms per step (wall), and per step the CPU ms of this thread and of the tracer's.

        A traced block starts and stops the tracer inside its timing, so the tracer's last
        write (what its thread had not written yet) counts too.
        """
        sync()
        t, cpu = time.perf_counter(), time.thread_time()
        if traced:
            job.start(job.directory)
        steps(n)
        tracer_cpu = _tracer_cpu()
        if traced:
            TRACER.stop()
        sync()
        per = 1e3 / n
        return (time.perf_counter() - t) * per, (time.thread_time() - cpu) * per, tracer_cpu * per

    res: dict[str, list[float]] = {"off": [], "on": []}
    cpu: dict[str, list[float]] = {"off": [], "on": [], "tracer": []}
    for i in range(args.blocks):
        for side in ("off", "on") if i % 2 == 0 else ("on", "off"):
            wall, mine, tracer = block(args.steps, side == "on")
            res[side].append(wall)
            cpu[side].append(mine)
            if side == "on":
                cpu["tracer"].append(tracer)
    a, b = statistics.median(res["off"]), statistics.median(res["on"])
    # Each block against the other side's block beside it: drift between pairs cancels.
    # The CPU time tracing adds: more on the program's thread, plus the tracer's own (when a
    # step is bound by the host launching work, as here, that is what the step pays).
    added = (
        statistics.median(cpu["on"]) - statistics.median(cpu["off"])
        + statistics.median(cpu["tracer"])
    )  # fmt: skip
    paired = statistics.median(on / off - 1 for on, off in zip(res["on"], res["off"], strict=True))
    lines = [
        f"{args.blocks} blocks of {args.steps} steps per side, alternated",
        f"tracing off: {a:.2f} ms/step (median; blocks {[round(v, 2) for v in res['off']]})",
        f"tracing on:  {b:.2f} ms/step (median; blocks {[round(v, 2) for v in res['on']]})",
        f"overhead: {b / a - 1:+.2%} (on / off - 1; bar 1 %); median of the pairs' ratios "
        f"{paired:+.2%}",
        f"CPU per step (medians): the program's thread {statistics.median(cpu['off']):.2f} ms "
        f"off, {statistics.median(cpu['on']):.2f} ms on; the tracer's thread "
        f"{statistics.median(cpu['tracer']):.3f} ms; tracing's CPU: {added:.3f} ms per step, "
        f"{added / a:+.2%} of the untraced step",
    ]
    doc = {**res, "cpu": cpu, "overhead": b / a - 1, "paired_overhead": paired,
           "cpu_added_ms": added}  # fmt: skip
    return lines, doc


if __name__ == "__main__":
    raise SystemExit(main())
