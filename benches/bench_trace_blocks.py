"""What tracing costs one process's ZeRO-3 steps: the tracer on and off, blocks alternated.

Separate runs of a short GPU job drift by more than the 1 % being measured (a run's step time
moved 25-39 ms on an H200 between runs of the same command). Here one process (world size 1)
trains ``bench_zero.py``'s GPT under ZeRO-3 and starts and stops the tracer between blocks
of ``--steps`` steps, alternating which side goes first, so both sides see the same drift;
it prints each side's median step time and ``on / off - 1``. The step times still drift by
more than a percent between blocks: it also prints the CPU time per step of the program's
thread on each side and of the tracer's thread, whose sum is what tracing costs a step that
the host's launching bounds. ``--no-gpu-times`` traces without the NCCL ops' GPU times;
``--torch-events`` takes them through torch's events, one Python call each, instead of the
driver's batches with the GIL released.

    python benches/bench_trace_blocks.py --device cuda              # medium GPT, bf16
    python benches/bench_trace_blocks.py --device cpu --size small --dtype fp32

Writes ``benches/results/trace-blocks-<tag>.{txt,json}``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _report
import torch
from bench_zero import SIZES

import shardline as sl
from shardline.comm.flight import RECORDER
from shardline.comm.trace import device as device_times
from shardline.comm.trace import folder
from shardline.comm.trace.recorder import TRACER
from shardline.examples.train import Config, TinyGPT


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    p.add_argument("--size", default="medium", choices=list(SIZES))
    p.add_argument("--dtype", default="bf16", choices=["fp32", "bf16"])
    p.add_argument("--blocks", type=int, default=8, help="blocks per side")
    p.add_argument(
        "--steps", type=int, default=100,
        help="steps per block (blocks longer than the tracer's 1 s interval)",
    )  # fmt: skip
    p.add_argument(
        "--no-gpu-times", action="store_true",
        help="trace without the NCCL ops' GPU times (host times only)",
    )  # fmt: skip
    p.add_argument(
        "--torch-events", action="store_true",
        help="GPU times through torch's events, one call each (the way before the driver's)",
    )  # fmt: skip
    p.add_argument("--tag", default=None)
    args = p.parse_args(argv)
    if args.torch_events:
        device_times.use_events(device_times.TORCH)
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29533"}.items():  # fmt: skip
        os.environ.setdefault(k, v)
    os.environ.pop("SHARDLINE_TRACE", None)  # the blocks say when it traces
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

    def block(n: int, traced: str | None) -> tuple[float, float, float]:
        """ms per step (wall), and per step the CPU ms of this thread and of the tracer's.

        A traced block starts and stops the tracer inside its timing, so the tracer's last
        write (what its thread had not written yet) counts too.
        """
        if cuda:
            torch.cuda.synchronize()
        t, cpu = time.perf_counter(), time.thread_time()
        if traced is not None:
            TRACER.start(traced, rank=0, world_size=1, backend=group.backend)
            if args.no_gpu_times:  # the tracer as it was before it read GPU times
                RECORDER.device_sink = None
        thread = TRACER._thread
        clock = time.pthread_getcpuclockid(thread.ident) if thread and thread.ident else None
        for _ in range(n):
            opt.zero_grad(set_to_none=True)
            model(x, y).backward()
            opt.step()
        tracer_cpu = time.clock_gettime(clock) if clock is not None else 0.0
        if traced is not None:
            TRACER.stop()
        if cuda:
            torch.cuda.synchronize()
        per = 1e3 / n
        return (time.perf_counter() - t) * per, (time.thread_time() - cpu) * per, tracer_cpu * per

    block(5, None)  # warm-up
    res: dict[str, list[float]] = {"off": [], "on": []}
    cpu: dict[str, list[float]] = {"off": [], "on": [], "tracer": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.blocks):
            for side in ("off", "on") if i % 2 == 0 else ("on", "off"):
                wall, mine, tracer = block(args.steps, f"{tmp}/t" if side == "on" else None)
                res[side].append(wall)
                cpu[side].append(mine)
                if side == "on":
                    cpu["tracer"].append(tracer)
        ops = folder.load(f"{tmp}/t")[0].ops
    records = len(ops)
    on_gpu = sum(1 for o in ops if folder.device_span(o) is not None)
    sl.shutdown()
    a, b = statistics.median(res["off"]), statistics.median(res["on"])
    # Each block against the other side's block beside it: drift between pairs cancels.
    # The CPU time tracing adds: more on the program's thread, plus the tracer's own (when a
    # step is bound by the host launching work, as here, that is what the step pays).
    added = (
        statistics.median(cpu["on"]) - statistics.median(cpu["off"])
        + statistics.median(cpu["tracer"])
    )  # fmt: skip
    paired = statistics.median(on / off - 1 for on, off in zip(res["on"], res["off"], strict=True))
    how = (
        "host times only" if args.no_gpu_times
        else "GPU times through torch's events" if args.torch_events
        else f"GPU times through {type(device_times.events()).__name__.strip('_')}"
    )  # fmt: skip
    lines = [
        f"zero3, 1 process, {args.device}, {args.size} GPT {args.dtype}, {args.blocks} blocks of "
        f"{args.steps} steps per side, alternated; {how}",
        f"tracing off: {a:.2f} ms/step (median; blocks {[round(v, 2) for v in res['off']]})",
        f"tracing on:  {b:.2f} ms/step (median; blocks {[round(v, 2) for v in res['on']]})",
        f"overhead: {b / a - 1:+.2%} (on / off - 1; bar 1 %); median of the pairs' ratios "
        f"{paired:+.2%}",
        f"{records} ops written in the last block, {on_gpu} with GPU times",
        f"CPU per step (medians): the program's thread {statistics.median(cpu['off']):.2f} ms "
        f"off, {statistics.median(cpu['on']):.2f} ms on; the tracer's thread "
        f"{statistics.median(cpu['tracer']):.3f} ms; tracing's CPU: {added:.3f} ms per step, "
        f"{added / a:+.2%} of the untraced step",
    ]
    tag = args.tag or f"{args.device}-{args.size}-{args.dtype}"
    _report.publish(
        _report.RESULTS / f"trace-blocks-{tag}",
        _report.header(Path(__file__).name, _report.machine(args.device)),
        "\n".join(lines),
        {
            "args": vars(args),
            **res,
            "cpu": cpu,
            "overhead": b / a - 1,
            "paired_overhead": paired,
            "cpu_added_ms": added,
        },
        lambda _path: "no plot: two numbers",
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
