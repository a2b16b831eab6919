"""Does sending less make training faster end to end? Compressors over shaped links, one run.

A GPT of about 100M parameters (the main job's ``TinyGPT``, ``--width 768 --layers 12``) trains
with AdamW on ``--ranks`` ranks on this machine's CPUs, one simulated host per rank: network
namespaces on one switch, each link limited to ``--rates`` (``1gbit``, ``10gbit``) by Linux
traffic control (``tests/multiprocess/_netns.py``), never by a knob of ours. Per rate:

1. ``dense``: our DDP, uncompressed, ``--steps`` steps. Its loss there (the mean of the last 5
   steps' loss, averaged over ranks) is the *target*.
2. each compressor (``powersgd``: rank 4, ``topk``: 1 % of each bucket, ``topk-tensor``: 1 %
   of each tensor, ``onebit``, ``int8``) with our DDP, ``onebit-adam`` (``sl.optim.OneBitAdam``,
   the variance frozen after a fifth of ``--steps``: 1-bit compression made for Adam),
   ``topk-adam`` (the same optimizer with ``TopK(0.01)`` on its momentum), and
   ``torch-powersgd`` (torch's DDP on Gloo with torch's ``powerSGD_hook`` at the same rank),
   until they reach the target or ``2 x --steps`` steps.

Reported: time per step, time to the target and its ratio to dense's, bytes per step (counted
by ``comm_stats()`` and by the interfaces' own counters), the loss after ``--steps`` steps
against dense's. Goals at 1 Gbit/s: PowerSGD, top-k and 1-bit reach the target >= 2x sooner
than dense with a loss within 1 %; PowerSGD as fast as torch's hook or faster.

``--gpu-cost --device cuda``: one GPU per rank over NCCL, links unshaped: each config's time
per step against dense's, which is the compressors' own cost where the links are fast.

``--straggler``: the same model on one host (shared memory), rank 0 made 3x slower (it
sleeps twice its compute time per step): DDP, local SGD (``sync_every=4``) and async SGD
(``on_stale="drop"``); the fast ranks' throughput with and without the straggler, and the
time to dense's target loss.

    python benches/bench_compression.py                      # needs root, ip and tc
    python benches/bench_compression.py --rates 1gbit --configs dense,powersgd --steps 20
    python benches/bench_compression.py --straggler-only
    python benches/bench_compression.py --gpu-cost --device cuda --tag cuda-4x   # 4 GPUs

Writes ``benches/results/compression-<tag>.{txt,json,png}`` (``--plot-only`` redraws the plot
from the JSON).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import re
import secrets
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT / "benches"))

import _harness  # noqa: E402
import _report  # noqa: E402

CONFIGS = ("dense", "powersgd", "topk", "topk-tensor", "onebit", "onebit-adam", "topk-adam",
           "int8", "torch-powersgd")  # fmt: skip


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=2, help="sequences per rank and step")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--rates", default="1gbit,10gbit")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--threads", type=int, default=0, help="per rank; 0: cores / ranks")
    p.add_argument("--straggler", action="store_true", help="also the straggler runs")
    p.add_argument("--straggler-only", action="store_true")
    p.add_argument("--plot-only", action="store_true", help="redraw the plot from the JSON")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument(
        "--gpu-cost",
        action="store_true",
        help="one GPU per rank, no shaping: each config's time per step against dense",
    )
    p.add_argument("--straggler-steps", type=int, default=20)
    p.add_argument("--straggler-modes", default="dense,local_sgd,async")
    p.add_argument("--tag", default="cpu")
    p.add_argument(
        "--reuse-dense",
        action="store_true",
        help="take each rate's dense run (the target) from this tag's JSON of an earlier call",
    )
    p.add_argument("--out-dir", default=str(ROOT / "benches" / "results"))
    # worker side
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--config", default="dense", help=argparse.SUPPRESS)
    p.add_argument("--target", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--max-steps", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--slow-rank", type=int, default=-1, help=argparse.SUPPRESS)
    p.add_argument("--out", default="", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# -- worker ------------------------------------------------------------------------------------


def reached(loss: float, target: float) -> bool:
    """Whether ``loss`` is at the target: within float noise of it counts, since a rerun of the
    run that set it sums its gradients in another order and can land a few ulps above."""
    return loss <= target * (1 + 1e-6)


def _model(args: argparse.Namespace) -> tuple[Any, Any, Any, Any]:
    import torch  # noqa: PLC0415

    from shardline.examples import train as ex  # noqa: PLC0415

    cfg = ex.Config(d_model=args.width, num_layers=args.layers, num_heads=args.heads,
                    seq_len=args.seq, batch_size=args.batch, steps=2 * args.steps + 10)  # fmt: skip
    tokens = ex.corpus(num_chars=2_000_000)
    torch.manual_seed(0)
    return torch, ex, cfg, tokens


def worker(args: argparse.Namespace) -> None:
    torch, ex, cfg, tokens = _model(args)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    model = ex.build_model(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    config = args.config
    if config == "torch-powersgd":
        import torch.distributed as dist  # noqa: PLC0415
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps  # noqa: PLC0415
        from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: PLC0415

        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        # On Gloo, torch's hook issues each bucket's all-reduces from callback threads, so
        # with several buckets ranks issue them in different orders and gloo aborts ("Received
        # data size doesn't match expected size"): one bucket there.
        cap = 25 if device.type == "cuda" else 4096
        net = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                  bucket_cap_mb=cap)  # fmt: skip
        state = ps.PowerSGDState(process_group=None, matrix_approximation_rank=4,
                                 start_powerSGD_iter=2, min_compression_rate=2,
                                 use_error_feedback=True, warm_start=True)  # fmt: skip
        net.register_comm_hook(state, ps.powerSGD_hook)

        def average(t: Any) -> None:
            dist.all_reduce(t)
            t.div_(world)

        def sent() -> int:
            return 0
    else:
        import shardline as sl  # noqa: PLC0415

        sl.init()
        options: dict[str, Any] = {}
        strategy = "ddp"
        if config in ("powersgd", "topk", "topk-tensor", "onebit", "int8", "fp8"):
            options["compression"] = {
                "powersgd": sl.compression.PowerSGD(rank=4),
                "topk": sl.compression.TopK(ratio=0.01),
                "topk-tensor": sl.compression.TopK(ratio=0.01, per_tensor=True),
                "onebit": sl.compression.OneBit(),
                "int8": sl.compression.Int8(),
                "fp8": sl.compression.FP8(),
            }[config]
        elif config in ("onebit-adam", "topk-adam"):
            strategy = "none"
        elif config == "local_sgd":
            strategy, options = "local_sgd", {"sync_every": 4}
        elif config == "async":
            strategy, options = "async", {"staleness": 2, "on_stale": "drop", "servers": world}
        if strategy == "none":  # 1-bit Adam communicates itself; the model stays plain
            from shardline.comm.world import default_group  # noqa: PLC0415

            net = model
            compressor = sl.compression.TopK(ratio=0.01) if config == "topk-adam" else None
            opt = sl.optim.OneBitAdam(model.parameters(), lr=args.lr, compressor=compressor,
                                      freeze_step=max(2, args.steps // 5))  # fmt: skip
            group = default_group()
            group.reset_traffic()

            def sent() -> int:
                row = group.traffic()
                return sum(v["sent"] for k, v in row.items() if k != "broadcast") - loss_bytes[0]
        else:
            net, opt = sl.distribute(model, opt, strategy=strategy, **options)

            def sent() -> int:
                return int(net.comm_stats()["sent"])

        loss_bytes = [0]

        def average(t: Any) -> None:
            sl.all_reduce(t)
            loss_bytes[0] += 2 * (world - 1) * t.numel() * t.element_size() // world
            t.div_(world)

    batches = ex.rank_batches(ex.windows(tokens, cfg), rank, world, cfg)
    probe = tuple(t.to(device) for t in ex.get_batch(tokens, list(range(0, 8 * 97, 97)), cfg))
    ifname = os.environ.get("BENCH_IFNAME")
    collective_loss = config not in ("async", "local_sgd")
    records = []
    recent: list[float] = []
    sleep_for = 0.0
    start = time.perf_counter()
    for step in range(1, args.max_steps + 1):
        t0 = time.perf_counter()
        x, y = (t.to(device) for t in ex.get_batch(tokens, batches[step - 1], cfg))
        opt.zero_grad()
        loss = net(x, y)
        loss.backward()
        compute = time.perf_counter() - t0
        if rank == args.slow_rank:  # a straggler: 3x this rank's compute time
            sleep_for = 2 * compute if step <= 3 else sleep_for
            time.sleep(sleep_for)
        opt.step()
        value = loss.detach().reshape(1).clone()
        if collective_loss:
            average(value)
        recent = [*recent, float(value)][-5:]
        smoothed = sum(recent) / len(recent)
        records.append({"step": step, "t": time.perf_counter() - start, "loss": float(value),
                        "smoothed": smoothed, "sent": sent()})  # fmt: skip
        if collective_loss and args.target and step >= 5 and reached(smoothed, args.target):
            break  # every rank sees the same averaged loss: they stop together
    if config == "async":
        net.close()
    with torch.no_grad():
        held = float(net(*probe)) if config != "torch-powersgd" else float(net.module(*probe))
    out = {"rank": rank, "config": config, "records": records, "held_out": held,
           "params": sum(p.numel() for p in model.parameters()),
           "nic": _nic(ifname) if ifname else None}  # fmt: skip
    if config in ("async", "local_sgd") and hasattr(net, "staleness"):
        out["staleness"] = {str(k): v for k, v in net.staleness().items()}
    Path(f"{args.out}.{rank}.json").write_text(json.dumps(out))
    if config == "torch-powersgd":
        import torch.distributed as dist  # noqa: PLC0415

        dist.destroy_process_group()
    else:
        import shardline as sl  # noqa: PLC0415

        sl.shutdown()


def _nic(ifname: str) -> dict[str, int]:
    """This rank's interface counters (``/proc/net/dev`` of its network namespace)."""
    tx, rx = _harness.simulated_hosts().nic_bytes(Path("/proc/net/dev").read_text(), ifname)
    return {"tx": tx, "rx": rx}


# -- parent ------------------------------------------------------------------------------------


def run_config(
    args: argparse.Namespace,
    config: str,
    hosts: Any,
    *,
    max_steps: int,
    target: float = 0.0,
    slow_rank: int = -1,
    timeout: float = 1800,
) -> list[dict[str, Any]]:
    """Runs ``config`` on every rank (rank ``r`` on host ``str(r)`` of ``hosts``, when given);
    returns each rank's report."""
    procs = _harness.launcher()
    n = args.ranks
    threads = args.threads or max(1, (os.cpu_count() or 2) // n)
    tmp = Path(tempfile.mkdtemp(prefix="shardline-bench-compression-"))
    before = [hosts.tx_rx(str(r)) for r in range(n)] if hosts is not None else None
    base = {k: v for k, v in os.environ.items() if not k.startswith("SHARDLINE_")}
    base.update(PYTHONPATH=f"{ROOT / 'python'}:{ROOT}:{base.get('PYTHONPATH', '')}",
                OMP_NUM_THREADS=str(threads), SHARDLINE_SECRET="bench-compression",
                SHARDLINE_TIMEOUT="600")  # fmt: skip
    env = {"SHARDLINE_BACKEND": "native", "CUDA_VISIBLE_DEVICES": ""}
    if args.device == "cuda":
        env = {"SHARDLINE_BACKEND": "nccl", "NCCL_NVLS_ENABLE": "0"}
    per_rank: dict[int, dict[str, str]] = {}
    if hosts is not None:
        env.update(MASTER_ADDR=hosts.addr("0"), LOCAL_WORLD_SIZE="1")
        per_rank = {r: {"LOCAL_RANK": "0", "SHARDLINE_HOST_ID": f"host-{r}",
                        "GLOO_SOCKET_IFNAME": hosts.ifname(str(r)),
                        "BENCH_IFNAME": hosts.ifname(str(r))} for r in range(n)}  # fmt: skip
    argv = ["-u", str(HERE), "--worker", "--config", config, "--out", str(tmp / "rank"),
            "--max-steps", str(max_steps), "--target", str(target), "--slow-rank",
            str(slow_rank), *_model_flags(args)]  # fmt: skip
    ranks = procs.start(
        n,
        args=argv,
        base=base,
        env=env,
        per_rank=per_rank,
        port=29400 + secrets.randbelow(2000),
        fresh=True,
        netns=(lambda r: hosts.ns(str(r))) if hosts is not None else None,
    )
    with contextlib.suppress(procs.RanksFailed):  # killed: reported below
        procs.finish(ranks, timeout)
    if any(r.rc for r in ranks):
        text = "\n".join(f"--- rank {r.rank} (rc {r.rc}) ---\n{(r.out + r.err)[-6000:]}"
                         for r in ranks)  # fmt: skip
        raise RuntimeError(f"{config} failed:\n{text}")
    reports = [json.loads(Path(f"{tmp}/rank.{r}.json").read_text()) for r in range(n)]
    if hosts is not None and before is not None:
        after = [hosts.tx_rx(str(r)) for r in range(n)]
        for r, rep in enumerate(reports):
            rep["wire_tx"] = after[r][0] - before[r][0]
    return reports


def _model_flags(args: argparse.Namespace) -> list[str]:
    return ["--width", str(args.width), "--layers", str(args.layers), "--heads", str(args.heads),
            "--seq", str(args.seq), "--batch", str(args.batch), "--steps", str(args.steps),
            "--lr", str(args.lr), "--device", args.device]  # fmt: skip


def summarize(reports: list[dict[str, Any]], steps: int, target: float) -> dict[str, Any]:
    rec = reports[0]["records"]
    at = next((r for r in rec if reached(r["smoothed"], target) and r["step"] >= 5), None)
    n_steps = len(rec)
    per_step = rec[-1]["t"] / n_steps
    at_steps = next((r for r in rec if r["step"] == steps), rec[-1])
    wire = sum(r.get("wire_tx", 0) for r in reports) / len(reports) / n_steps
    return {
        "steps": n_steps,
        "s_per_step": per_step,
        "to_target_s": at["t"] if at else None,
        "to_target_steps": at["step"] if at else None,
        "loss_at_steps": at_steps["smoothed"],
        "held_out": reports[0]["held_out"],
        "sent_per_step": rec[-1]["sent"] / n_steps,
        "wire_per_step": wire,
        "curve": [(r["t"], r["smoothed"], r["sent"]) for r in rec],
    }


def main() -> None:
    args = parse()
    if args.worker:
        worker(args)
        return
    netns = _harness.simulated_hosts()

    results: dict[str, Any] = {
        "args": vars(args),
        "rates": {},
        "machine": _report.machine(args.device, gpu_count=True),
    }
    earlier = Path(args.out_dir) / f"compression-{args.tag}.json"
    if earlier.exists():  # a later call adds configs to an earlier one's results
        old = json.loads(earlier.read_text())
        results["rates"] = old.get("rates", {})
        for part in ("straggler", "gpu"):
            if part in old:
                results[part] = old[part]
    configs = [c for c in args.configs.split(",") if c]
    if args.plot_only:
        stem = Path(args.out_dir) / f"compression-{args.tag}"
        print(_report.plot(stem.with_suffix(".png"), lambda plt: _draw(plt, results)))
        return
    if args.gpu_cost:
        results["gpu"] = _gpu_cost(args, configs)
        print("\n".join(_gpu_table(results["gpu"])), flush=True)
        _write(args, results)
        return
    if not args.straggler_only:
        why = netns.namespaces_allowed()
        if why:
            raise SystemExit(f"bench_compression: cannot simulate hosts here: {why}")
        hosts = netns.Hosts([str(r) for r in range(args.ranks)], tag="slb", subnet="10.78.0")
        hosts.open()
        try:
            for rate in [r for r in args.rates.split(",") if r]:
                hosts.shape(rate)
                before = results["rates"].get(rate, {})

                def save(part: dict[str, Any], rate: str = rate, before: dict = before) -> None:
                    results["rates"][rate] = {**before, **part}
                    _write(args, results)  # after every config: a cut-off run keeps its results

                save(_one_rate(args, hosts, configs, before, save))
                print("\n".join(_rate_table(rate, results["rates"][rate])), flush=True)
                _write(args, results)
        finally:
            hosts.close()
    if args.straggler or args.straggler_only:
        results["straggler"] = {**results.get("straggler", {}), **_straggler(args)}
        print("\n".join(_straggler_table(results["straggler"])), flush=True)
    _write(args, results)


def _one_rate(
    args: argparse.Namespace,
    hosts: Any,
    configs: list[str],
    before: dict[str, Any],
    save: Any,
) -> dict[str, Any]:
    if args.reuse_dense and "dense" in before:
        dense = before["dense"]
    else:
        dense = summarize(run_config(args, "dense", hosts, max_steps=args.steps), args.steps, -1.0)
        dense["to_target_s"] = dense["curve"][-1][0]
    target = dense["loss_at_steps"]
    out = {"target": target, "dense": dense}
    save(out)
    for config in configs:
        if config == "dense":
            continue
        try:
            reports = run_config(args, config, hosts, max_steps=2 * args.steps, target=target)
        except RuntimeError as exc:  # recorded, and the other configs still run
            out[config] = {"failed": _first_error(str(exc))}
        else:
            out[config] = summarize(reports, args.steps, target)
        save(out)
    return out


def _first_error(text: str) -> str:
    """Each rank's first line that names an error (else the output's end)."""
    found: dict[str, str] = {}
    rank = "?"
    for line in text.splitlines():
        if line.startswith("--- rank "):
            rank = line.split()[2]
        elif re.match(r"^(\[rank\d+\]: )?[\w.]*(Error|Exception): ", line.strip()):
            found.setdefault(rank, line.strip()[:300])
    return " | ".join(f"rank {r}: {m}" for r, m in found.items()) or text[-300:]


def _rate_table(rate: str, got: dict[str, Any]) -> list[str]:
    target, dense = got["target"], got["dense"]
    lines = [
        f"\n-- links shaped to {rate}: target loss {target:.4f} (dense after "
        f"{dense['steps']} steps)",
        f"{'config':<16}{'s/step':>8}{'to target':>11}{'speed-up':>10}{'steps':>7}"
        f"{'MB/step':>9}{'wire MB':>9}{'loss@N':>9}{'vs dense':>9}",
    ]
    for name, s in got.items():
        if name == "target":
            continue
        if "failed" in s:
            lines.append(f"{name:<16}failed: {s['failed']}")
            continue
        t = s["to_target_s"]
        speed = dense["to_target_s"] / t if t else float("nan")
        lines.append(
            f"{name:<16}{s['s_per_step']:>8.2f}{(f'{t:.1f}s' if t else 'never'):>11}"
            f"{speed:>9.2f}x{s['to_target_steps'] or s['steps']:>7}"
            f"{s['sent_per_step'] / 1e6:>9.2f}{s['wire_per_step'] / 1e6:>9.2f}"
            f"{s['loss_at_steps']:>9.4f}{s['loss_at_steps'] / target - 1:>+9.2%}"
        )
    return lines


def _straggler(args: argparse.Namespace) -> dict[str, Any]:
    """Each mode without and with the straggler; dense's loss without it is the target."""
    out: dict[str, Any] = {}
    tokens_per_step = args.batch * args.seq
    target = 0.0
    for mode in args.straggler_modes.split(","):
        rates, held, took, reached = [], 0.0, 0.0, None
        for slow in (-1, 0):
            # With the straggler, up to twice the steps, to see when the target is reached.
            steps = args.straggler_steps if slow < 0 else 2 * args.straggler_steps
            reports = run_config(args, mode, None, max_steps=steps, slow_rank=slow,
                                 target=target if slow >= 0 else 0.0)  # fmt: skip
            fast = [r for r in reports if r["rank"] != slow]
            rate = sum(len(r["records"]) * tokens_per_step / r["records"][-1]["t"] for r in fast)
            rates.append(rate)
            held = reports[0]["held_out"]
            took = max(r["records"][-1]["t"] for r in reports)
            if slow < 0 and mode == "dense":
                target = reports[0]["records"][-1]["smoothed"]
            if slow >= 0 and target:
                reached = _time_to(fast, target)
        out[mode] = {"fast_tok_s": rates[1], "baseline_tok_s": rates[0],
                     "kept": rates[1] / rates[0], "held_out": held, "job_s": took,
                     "target": target, "to_target_s": reached}  # fmt: skip
    return out


def _time_to(reports: list[dict[str, Any]], target: float) -> float | None:
    """When the mean of the ranks' smoothed losses, step by step, first reaches ``target``.

    Each rank logs the loss of its own batches (async and local SGD average none), so the mean
    over ranks at a step is the comparable figure; its time is the latest rank's.
    """
    steps = min(len(r["records"]) for r in reports)
    for i in range(4, steps):
        rows = [r["records"][i] for r in reports]
        if reached(sum(x["smoothed"] for x in rows) / len(rows), target):
            return max(x["t"] for x in rows)
    return None


def _straggler_table(got: dict[str, Any]) -> list[str]:
    target = next((s.get("target") for s in got.values() if s.get("target")), None)
    lines = [
        "\n-- straggler: rank 0 sleeps 2x its compute per step (3x slower); one host"
        + (f"; target loss {target:.4f} (dense without it)" if target else ""),
        f"{'mode':<12}{'fast ranks tok/s':>18}{'no straggler':>14}{'kept':>7}"
        f"{'held-out':>10}{'job s':>8}{'to target':>11}",
    ]
    for mode, s in got.items():
        t = s.get("to_target_s")
        lines.append(
            f"{mode:<12}{s['fast_tok_s']:>18,.0f}{s['baseline_tok_s']:>14,.0f}{s['kept']:>7.0%}"
            f"{s['held_out']:>10.4f}{s.get('job_s', 0):>8.1f}"
            + (f"{t:>10.1f}s" if t is not None else f"{'never':>11}")
        )
    return lines


def _gpu_cost(args: argparse.Namespace, configs: list[str]) -> dict[str, Any]:
    """Each config for ``--steps`` steps on the GPUs: the median step after 5 of warm-up."""
    out: dict[str, Any] = {}
    for config in configs:
        try:
            reports = run_config(args, config, None, max_steps=args.steps, timeout=300)
        except RuntimeError as exc:
            out[config] = {"failed": _first_error(str(exc))}
            continue
        rec = reports[0]["records"]
        gaps = sorted(b["t"] - a["t"] for a, b in itertools.pairwise(rec[5:]))
        out[config] = {"s_per_step": gaps[len(gaps) // 2] if gaps else rec[-1]["t"],
                       "sent_per_step": rec[-1]["sent"] / len(rec),
                       "loss": rec[-1]["smoothed"]}  # fmt: skip
    return out


def _gpu_table(got: dict[str, Any]) -> list[str]:
    dense = got.get("dense", {}).get("s_per_step")
    lines = ["\n-- one GPU per rank, NCCL, no shaping: the compressors' own cost",
             f"{'config':<16}{'ms/step':>9}{'vs dense':>10}{'MB/step':>9}{'loss':>9}"]  # fmt: skip
    for name, s in got.items():
        if "failed" in s:
            lines.append(f"{name:<16}failed: {s['failed']}")
            continue
        ratio = s["s_per_step"] / dense if dense else float("nan")
        lines.append(f"{name:<16}{1e3 * s['s_per_step']:>9.1f}{ratio:>9.2f}x"
                     f"{s['sent_per_step'] / 1e6:>9.2f}{s['loss']:>9.4f}")  # fmt: skip
    return lines


def _write(args: argparse.Namespace, results: dict[str, Any]) -> None:
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    base = out / f"compression-{args.tag}"
    a = results["args"]
    lines = [
        f"bench_compression: {a['ranks']} ranks, GPT width {a['width']} x {a['layers']} layers, "
        f"{a['batch']} x {a['seq']} tokens per rank, AdamW lr {a['lr']}; {results['machine']}"
    ]
    for rate, got in results["rates"].items():
        lines += _rate_table(rate, got)
    if "straggler" in results:
        lines += _straggler_table(results["straggler"])
    if "gpu" in results:
        lines += _gpu_table(results["gpu"])
    base.with_suffix(".txt").write_text("\n".join(lines) + "\n")
    base.with_suffix(".json").write_text(json.dumps(results, indent=1))
    print(_report.plot(base.with_suffix(".png"), lambda plt: _draw(plt, results)))


def _draw(plt: Any, results: dict[str, Any]) -> Any:
    """Loss against seconds and against MB sent per rank, one row per link rate."""
    rates = results["rates"]
    if not rates:
        return "no plot: no shaped-link runs"
    fig, axes = plt.subplots(len(rates), 2, figsize=(12, 4.2 * len(rates)), squeeze=False)
    for row, (rate, got) in enumerate(rates.items()):
        for name, s in got.items():
            if name == "target" or "curve" not in s:
                continue
            t, loss, sent = zip(*s["curve"], strict=True)
            axes[row][0].plot(t, loss, label=name)
            if name != "torch-powersgd":  # torch does not count its bytes
                axes[row][1].plot([b / 1e6 for b in sent], loss, label=name)
        for col, what in enumerate(("seconds", "MB sent per rank")):
            ax = axes[row][col]
            ax.axhline(got["target"], color="grey", lw=0.8, ls="--")
            ax.set_xlabel(what)
            ax.set_ylabel("training loss (5-step mean)")
            ax.set_title(f"links at {rate}: loss vs {what}")
            ax.legend(fontsize=8)
    return fig


if __name__ == "__main__":
    main()
