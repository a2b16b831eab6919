"""How long a job takes to recover from a killed rank: ours against torchrun + DCP, one run.

The same job on both sides: the main job's GPT (``shardline.examples.train``'s ``TinyGPT``,
``--width``/``--layers`` to make it bigger), AdamW, ``--ranks`` ranks on this machine's CPUs
(or GPUs, ``--device cuda``: NCCL on both sides), ``--steps`` steps; rank 1 is killed
(SIGKILL, by itself) in the middle of step ``--kill-at``, after its backward and before its
optimizer step.

- ours: ``shardline run --nnodes 1:1 --max-restarts 3``, ZeRO-2, ``sl.elastic.State``
  committed after every step, the training function under ``sl.elastic.run``: the launcher
  hands the dead worker's place to its warm standby, the others re-form the group in place
  and the state comes back from memory (the replacement's share from its buddy).
- torch: ``torchrun --max-restarts 3``, FSDP2 ``fully_shard`` with
  ``reshard_after_forward=False`` (ZeRO-2) where this torch can, else DDP, and a DCP
  checkpoint (``torch.distributed.checkpoint``) every ``--ckpt-every`` steps, loaded at start:
  torchrun restarts every worker, which resume from the latest checkpoint.

Rank 0 logs the wall time each step ends; the killed rank logs when it dies. Recovery = the
end of the first step completed after the kill minus the kill; "redone" = steps trained again
(the step in flight counts). Also prints each side's steady step time and what a commit (ours)
or a checkpoint (torch) costs per step.

    python benches/bench_recovery.py                   # 4 ranks, kill at step 50, ~2 min here
    python benches/bench_recovery.py --ranks 8 --width 256 --layers 8
    python benches/bench_recovery.py --device cuda --width 1024 --layers 8 --tag cuda-4x

torchrun's env:// store hands a restarted attempt the previous attempt's Gloo addresses on
torch 2.15 (every restart failed in connectFullMesh here), so the torch worker makes its group
on a store prefix of its own per attempt.

Writes ``benches/results/recovery-<tag>.{txt,json}``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))
ROOT = HERE.parents[1]


# -- the workers -------------------------------------------------------------------------------


def _setup(args: argparse.Namespace) -> tuple:  # type: ignore[type-arg]
    import torch  # noqa: PLC0415

    from shardline.examples import train as ex  # noqa: PLC0415

    cfg = ex.Config(d_model=args.width, num_layers=args.layers, num_heads=4, seq_len=64,
                    batch_size=args.batch)  # fmt: skip
    tokens = ex.corpus()
    model = ex.build_model(cfg)
    return torch, ex, cfg, tokens, model


def _device(args: argparse.Namespace, torch: Any) -> Any:
    """This rank's device: ``cuda:LOCAL_RANK`` with ``--device cuda`` (after ``init``)."""
    if args.device != "cuda":
        return torch.device("cpu")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    return device


def _log(out: Path, **entry: object) -> None:
    with open(out / "steps.jsonl", "a") as f:
        f.write(json.dumps(entry) + "\n")


def _maybe_die(out: Path, args: argparse.Namespace, rank: int, step: int, first: bool) -> None:
    if first and rank == 1 and step == args.kill_at:
        (out / "kill.json").write_text(json.dumps({"t": time.time(), "step": step}))
        os.kill(os.getpid(), signal.SIGKILL)


def worker_ours(args: argparse.Namespace) -> None:
    torch, ex, cfg, tokens, model = _setup(args)
    import shardline as sl  # noqa: PLC0415

    out = Path(args.dir)
    from shardline.comm import world  # noqa: PLC0415

    sl.init()
    place = world.elastic_slot()
    first = place is not None and place[1] == 0  # a replacement does not die again
    device = _device(args, torch)
    model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    net, opt = sl.distribute(model, opt, strategy="zero2")
    sampler = sl.DistributedSampler(ex.windows(tokens, cfg), seed=0)
    state = sl.elastic.State(model=net, optimizer=opt, sampler=sampler, step=0)

    @sl.elastic.run
    def train(state: sl.elastic.State) -> None:
        it = iter(sampler)
        while state.step < args.steps:
            x, y = ex.get_batch(tokens, [next(it) for _ in range(cfg.batch_size)], cfg)
            loss = net(x.to(device), y.to(device))
            opt.zero_grad()
            loss.backward()
            _maybe_die(out, args, sl.get_rank(), state.step + 1, first)
            opt.step()
            state.step += 1
            t = time.perf_counter()
            state.commit()
            commit = time.perf_counter() - t
            if sl.get_rank() == 0:
                _log(out, step=state.step, t=time.time(), commit=commit)

    train(state)
    sl.shutdown()


def worker_torch(args: argparse.Namespace) -> None:
    torch, ex, cfg, tokens, model = _setup(args)
    import torch.distributed as dist  # noqa: PLC0415
    import torch.distributed.checkpoint as dcp  # noqa: PLC0415
    from torch.distributed.checkpoint.state_dict import (  # noqa: PLC0415
        get_state_dict,
        set_state_dict,
    )

    out = Path(args.dir)
    # torchrun's own env:// store hands a restarted attempt the previous attempt's Gloo
    # addresses on this torch (connectFullMesh refused, every restart): a prefix per attempt.
    from datetime import timedelta  # noqa: PLC0415

    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), None,
                          False, timedelta(seconds=120))  # fmt: skip
    device = _device(args, torch)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            store=dist.PrefixStore(f"bench/attempt{attempt}", store),
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                            device_id=device if device.type == "cuda" else None)  # fmt: skip
    model.to(device)
    rank = dist.get_rank()
    first = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: PLC0415

        for block in model.blocks:  # type: ignore[attr-defined]
            fully_shard(block, reshard_after_forward=False)
        net = fully_shard(model, reshard_after_forward=False)
        kind = "FSDP2 (reshard_after_forward=False)"
    except Exception as exc:  # this torch cannot shard here: DDP
        net = torch.nn.parallel.DistributedDataParallel(model)
        kind = f"DDP (fully_shard failed: {exc})"
    if rank == 0:
        (out / "strategy.txt").write_text(kind)
    opt = torch.optim.AdamW(net.parameters(), lr=cfg.lr)
    sampler = torch.utils.data.DistributedSampler(range(ex.windows(tokens, cfg)), seed=0)
    step = 0
    ckpts = sorted((p for p in (out / "dcp").glob("step-*") if (p / ".metadata").exists()),
                   key=lambda p: int(p.name.split("-")[1]))  # complete ones only  # fmt: skip
    if ckpts:
        msd, osd = get_state_dict(net, opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=str(ckpts[-1]))
        set_state_dict(net, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        step = int(ckpts[-1].name.split("-")[1])
    order = list(sampler)
    while step < args.steps:
        at = (step * cfg.batch_size) % (len(order) - cfg.batch_size)
        x, y = ex.get_batch(tokens, order[at : at + cfg.batch_size], cfg)
        loss = net(x.to(device), y.to(device))
        opt.zero_grad()
        loss.backward()
        _maybe_die(out, args, rank, step + 1, first)
        opt.step()
        step += 1
        t = time.perf_counter()
        if step % args.ckpt_every == 0:
            msd, osd = get_state_dict(net, opt)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(out / "dcp" / f"step-{step}"))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        save = time.perf_counter() - t
        if rank == 0:
            _log(out, step=step, t=time.time(), commit=save)
    dist.destroy_process_group()


# -- the driver ---------------------------------------------------------------------------------


def _free_port() -> int:
    import socket  # noqa: PLC0415

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(side: str, args: argparse.Namespace, out: Path) -> dict[str, object]:
    out.mkdir(parents=True)
    me = [str(HERE), "--worker", side, "--dir", str(out), *_passed(args)]
    port = str(_free_port())
    if side == "ours":
        cmd = [sys.executable, "-m", "shardline", "run", "--nnodes", "1:1", "--nproc-per-node",
               str(args.ranks), "--max-restarts", "3", "--master-port", port, *me]  # fmt: skip
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.ranks),
               "--max-restarts", "3", "--master-port", port, *me]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "python"), str(ROOT)]),
           "SHARDLINE_SECRET": "bench-recovery", "OMP_NUM_THREADS": "1"}  # fmt: skip
    t0 = time.time()
    proc = subprocess.run(
        cmd, env=env, capture_output=True, text=True, timeout=args.timeout, check=False
    )
    if proc.returncode != 0:
        print(proc.stdout[-4000:], proc.stderr[-8000:], file=sys.stderr)
        raise SystemExit(f"{side}: the job failed (exit {proc.returncode})")
    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    kill = json.loads((out / "kill.json").read_text())
    after = next(s for s in steps if s["t"] > kill["t"])
    before = [s for s in steps if s["t"] < kill["t"]]
    durations = [b["t"] - a["t"] for a, b in itertools.pairwise(steps)
                 if b["step"] == a["step"] + 1 and b["t"] < kill["t"]]  # fmt: skip
    strategy = out / "strategy.txt"
    return {
        "strategy": strategy.read_text() if strategy.exists() else "shardline zero2",
        "recovery_s": after["t"] - kill["t"],
        "resumed_at": after["step"] - 1,
        "redone": kill["step"] - (after["step"] - 1),
        "step_s": statistics.median(durations[len(durations) // 4 :]),
        # Mean, not median: torch's checkpoint costs every --ckpt-every steps, nothing between.
        "commit_s": statistics.fmean(s["commit"] for s in before[len(before) // 4 :]),
        "last_before_kill": before[-1]["step"] if before else 0,
        "wall_s": time.time() - t0,
    }


def _passed(args: argparse.Namespace) -> list[str]:
    return ["--device", args.device, "--steps", str(args.steps), "--kill-at", str(args.kill_at),
            "--ckpt-every", str(args.ckpt_every), "--width", str(args.width), "--layers",
            str(args.layers), "--batch", str(args.batch)]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--steps", type=int, default=70)
    p.add_argument("--kill-at", type=int, default=50)
    p.add_argument("--ckpt-every", type=int, default=10, help="torch: DCP checkpoint interval")
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument(
        "--batch", type=int, default=8, help="sequences per rank (one epoch: 97 steps at 4 ranks)"
    )
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--tag", default="cpu")
    p.add_argument("--worker", choices=("ours", "torch"), help=argparse.SUPPRESS)
    p.add_argument("--dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker == "ours":
        worker_ours(args)
        return 0
    if args.worker == "torch":
        worker_torch(args)
        return 0

    import _report  # noqa: PLC0415

    tmp = Path(tempfile.mkdtemp(prefix="shardline-recovery-"))
    try:
        ours = _run("ours", args, tmp / "ours")
        theirs = _run("torch", args, tmp / "torch")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    lines = [
        f"job: TinyGPT d={args.width} L={args.layers}, {args.ranks} ranks on {args.device}, batch "
        f"{args.batch}x64 per rank, rank 1 killed in step {args.kill_at}",
        f"{'':36}{'shardline':>12}{'torchrun+DCP':>15}",
    ]
    for key, what, unit in (("recovery_s", "kill -> next step done (s)", True),
                            ("redone", "steps redone", False),
                            ("step_s", "steady step time (s)", True),
                            ("commit_s", "commit or checkpoint, per step (s)", True)):  # fmt: skip
        a, b = ours[key], theirs[key]
        fmt = "{:>12.3f}{:>15.3f}" if unit else "{:>12}{:>15}"
        lines.append(f"{what:<36}" + fmt.format(a, b))
    lines.append(f"recovery: shardline takes {ours['recovery_s'] / theirs['recovery_s']:.3f}x "
                 "torchrun+DCP's time (goal <= 0.2x); torch checkpoints every "
                 f"{args.ckpt_every} steps, shardline commits every step")  # fmt: skip
    lines.append(f"torch side: {theirs['strategy']}")
    head = _report.header("bench_recovery.py", _report.machine(args.device, gpu_count=True))
    doc = {"ours": ours, "torch": theirs, "args": vars(args)}
    stem = HERE.parent / "results" / f"recovery-{args.tag}"
    _report.publish(stem, head, "\n".join(lines), doc, lambda path: "no plot")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
