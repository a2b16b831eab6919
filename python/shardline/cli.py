"""The ``shardline`` command line.

``shardline run`` starts a training script on many ranks; ``shardline ckpt info|verify|
consolidate`` inspects, checks and exports checkpoints; ``shardline why DIR`` reads the flight
recorder's dumps and says who holds a job up.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from shardline import checkpoint
from shardline._version import __version__
from shardline.comm import why
from shardline.comm.trace import doctor
from shardline.comm.trace import merge as trace_merge
from shardline.errors import CheckpointError, InvalidArgumentError
from shardline.launch import DEFAULT_GRACE_PERIOD_S, LaunchConfig, launch

__all__ = ["build_parser", "main"]

_RUN_EPILOG = """\
Every worker gets torchrun's variables (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
GROUP_RANK, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RESTART_COUNT) plus SHARDLINE_SECRET and
SHARDLINE_RESTART_COUNT, so the same script also runs under torchrun and srun. As torchrun's
agent does, the launcher of node 0 hosts the rendezvous store at MASTER_ADDR:MASTER_PORT for
the whole attempt (TORCHELASTIC_USE_AGENT_STORE=True), so it outlives every worker.

examples:
  shardline run --nproc-per-node 4 train.py --lr 0.1
  shardline run --nproc-per-node 8 -m mypkg.train
  # two nodes: export the same SHARDLINE_SECRET on both, then
  shardline run --nnodes 2 --node-rank 0 --master-addr node0 --master-port 29500 \\
      --nproc-per-node 8 train.py
  # elastic: run the same line on every node (2 to 4 of them); a node may join later
  shardline run --nnodes 2:4 --max-restarts 3 --master-addr node0 --master-port 29500 \\
      --nproc-per-node 8 train.py
"""


def _nnodes(text: str) -> tuple[int | None, int]:
    """``--nnodes``: ``N`` (fixed: ``(None, N)``) or ``MIN:MAX`` (elastic)."""
    try:
        if ":" in text:
            low, high = text.split(":", 1)
            return int(low), int(high)
        return None, int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not N or MIN:MAX") from None


def _version() -> str:
    """``shardline X, engine Y, torch Z``."""
    try:
        from shardline import _native  # noqa: PLC0415  (the package works without the engine)

        engine = _native.__version__
    except ImportError:
        engine = "not built"
    return f"shardline {__version__} (engine {engine}, torch {torch.__version__})"


class _Version(argparse.Action):
    """``--version``: the versions, found only when asked (the launcher starts without torch)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **_: Any) -> None:
        super().__init__(
            option_strings,
            dest,
            nargs=0,
            help="print shardline's, its engine's and torch's version",
        )

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> None:
        print(_version())
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``shardline`` and its ``run`` subcommand."""
    parser = argparse.ArgumentParser(
        prog="shardline", description="Train PyTorch models across processes with shardline."
    )
    parser.add_argument("--version", action=_Version)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run = commands.add_parser(
        "run",
        help="start a training script on many ranks (like torchrun)",
        description="Start a training script on many ranks of this node (like torchrun).",
        epilog=_RUN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    run.add_argument(
        "--nproc-per-node",
        "--nproc_per_node",
        dest="nproc_per_node",
        type=int,
        default=1,
        metavar="N",
        help="workers on this node (default: 1)",
    )
    run.add_argument(
        "--nnodes",
        type=_nnodes,
        default=(None, 1),
        metavar="N|MIN:MAX",
        help="nodes in the job (default: 1); MIN:MAX makes the job elastic: workers that die "
        "are replaced without restarting the others, and nodes may leave and join while "
        "MIN to MAX remain (needs --master-port)",
    )
    run.add_argument(
        "--node-rank",
        "--node_rank",
        dest="node_rank",
        type=int,
        default=0,
        metavar="R",
        help="this node's index in [0, nnodes) (default: 0)",
    )
    run.add_argument(
        "--master-addr",
        "--master_addr",
        dest="master_addr",
        default="127.0.0.1",
        metavar="HOST",
        help="host of node 0, reachable from every node (default: 127.0.0.1)",
    )
    run.add_argument(
        "--master-port",
        "--master_port",
        dest="master_port",
        type=int,
        default=None,
        metavar="PORT",
        help="port of the rendezvous store node 0's launcher hosts (default: a free port; "
        "required with --nnodes > 1)",
    )
    run.add_argument(
        "--max-restarts",
        "--max_restarts",
        dest="max_restarts",
        type=int,
        default=0,
        metavar="N",
        help="restart the workers up to N times after a failure (default: 0)",
    )
    run.add_argument(
        "--no-prefix",
        dest="prefix_output",
        action="store_false",
        help="print worker output as is, without the [rank<N>]: prefix",
    )
    run.add_argument(
        "-m",
        "--module",
        action="store_true",
        help="run the target as a module (python -m target) instead of a script",
    )
    run.add_argument("target", metavar="script.py | module", help="what every worker runs")
    run.add_argument(
        "args", nargs=argparse.REMAINDER, help="arguments passed to the script unchanged"
    )
    ckpt = commands.add_parser("ckpt", help="inspect, check or export a checkpoint")
    actions = ckpt.add_subparsers(dest="action", required=True, metavar="ACTION")
    info = actions.add_parser("info", help="what a checkpoint holds and how it was saved")
    info.add_argument("path", help="a checkpoint directory, or a root (its latest checkpoint)")
    verify = actions.add_parser("verify", help="check every checksum and the index")
    verify.add_argument("path")
    cons = actions.add_parser(
        "consolidate", help="write the model as Hugging Face-style safetensors files"
    )
    cons.add_argument("path")
    cons.add_argument("out", help="output directory")
    cons.add_argument(
        "--max-shard-gb", type=float, default=5.0, help="split files above this size (5)"
    )
    why = commands.add_parser(
        "why",
        help="say who holds a job up, from its ranks' flight-recorder dumps",
        description="Merge the flight recorder's rank<r>.json dumps (written when an op fails "
        "or on SIGUSR1; SHARDLINE_FLIGHT_DIR) into one sentence: which rank never entered "
        "which op, and what the others wait in.",
    )
    why.add_argument("dir", help="the folder holding rank<r>.json (an error message names it)")
    why.add_argument("--ops", type=int, default=0, metavar="N",
                     help="also list each rank's last N ops")  # fmt: skip
    doctor = commands.add_parser(
        "doctor",
        help="say what holds a traced job up: a hang's culprit, a straggler, a mismatch",
        description="Read the folder a job traces into (SHARDLINE_TRACE=DIR), live or after "
        "its end, and name: the rank a hung collective waits for (and why: gone, silent, in "
        "another op, busy at file:line), ranks that called different ops, a rank slower than "
        "the others, and settings that differ between ranks. Exit status 1 when it finds one.",
    )
    doctor.add_argument("dir", help="the job's SHARDLINE_TRACE folder")
    doctor.add_argument(
        "--steps",
        type=int,
        default=20,
        help="the straggler check's window, in optimizer steps (20)",
    )
    doctor.add_argument(
        "--slower",
        type=float,
        default=0.07,
        help="how much slower a straggler is, as a fraction (0.07)",
    )
    doctor.add_argument(
        "--hang-after",
        type=float,
        default=2.0,
        metavar="SECONDS",
        help="how long ranks must wait in a collective to call it a hang (2)",
    )
    doctor.add_argument(
        "--wait",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="a live job timed on its GPUs on some steps only (SHARDLINE_TRACE_GPU) is asked "
        "for GPU times on every one of its next --steps steps: how long to wait for them "
        "(60; 0: do not ask)",
    )
    doctor.add_argument(
        "--all",
        action="store_true",
        help="read every rank's whole timeline (by default its last 8 MiB: its recent ops)",
    )
    trace = commands.add_parser("trace", help="work with a traced job's timelines")
    trace_actions = trace.add_subparsers(dest="action", required=True, metavar="ACTION")
    merge_cmd = trace_actions.add_parser(
        "merge", help="every rank's timeline as one Chrome/Perfetto trace (ui.perfetto.dev)"
    )
    merge_cmd.add_argument("dir", help="the job's SHARDLINE_TRACE folder")
    merge_cmd.add_argument("-o", "--out", default=None, help="where to write (DIR/trace.json)")
    return parser


def _doctor(ns: argparse.Namespace) -> int:
    try:
        report = doctor.diagnose(ns.dir, steps=ns.steps, slower=ns.slower,
                                 hang_after=ns.hang_after, wait=ns.wait,
                                 history=None if ns.all else doctor.HISTORY_BYTES)  # fmt: skip
    except InvalidArgumentError as exc:
        print(f"shardline doctor: error: {exc}", file=sys.stderr)
        return 2
    print(report.text())
    return 1 if report.findings else 0


def _trace(ns: argparse.Namespace) -> int:
    try:
        path = trace_merge.merge(ns.dir, ns.out)
    except InvalidArgumentError as exc:
        print(f"shardline trace merge: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # the output's folder is missing or not writable
        print(f"shardline trace merge: error: cannot write the trace: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0


def _why(ns: argparse.Namespace) -> int:
    try:
        dumps = why.load_dumps(Path(ns.dir))
    except ValueError as exc:
        print(f"shardline why: error: {exc}", file=sys.stderr)
        return 1
    print(why.explain_dumps(dumps) or "no rank was waiting in a collective")
    for d in dumps if ns.ops > 0 else []:
        print(f"rank {d['rank']} (pid {d['pid']} on {d['host']}; dumped for: {d['reason']}):")
        for line in why.describe_ops(d, ns.ops):
            print(f"  {line}")
    return 0


def _ckpt(ns: argparse.Namespace) -> int:
    path = Path(ns.path)
    try:
        if not (path / "COMMIT").exists() and (found := checkpoint.latest(path)) is not None:
            path = found
        if ns.action == "info":
            print(json.dumps(checkpoint.info(path), indent=1, default=str))
        elif ns.action == "verify":
            checkpoint.verify(path)
            print(f"{path}: ok")
        else:
            files = checkpoint.consolidate(path, ns.out, int(ns.max_shard_gb * (1 << 30)))
            print("\n".join(str(f) for f in files))
    except CheckpointError as exc:
        print(f"shardline ckpt {ns.action}: error: {exc}", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the ``shardline`` command line.

    Args:
        argv: The arguments after the program name; ``sys.argv[1:]`` by default.

    Returns:
        The exit status: 0 on success, 2 for bad arguments, 130 or 143 when stopped by
        SIGINT or SIGTERM, else the exit code of the worker that failed.
    """
    parser = build_parser()
    try:
        ns = parser.parse_args(argv)
    except SystemExit as exc:  # --help, or an argparse error it already printed
        return exc.code if isinstance(exc.code, int) else 2
    tools = {"ckpt": _ckpt, "why": _why, "doctor": _doctor, "trace": _trace}
    if ns.command in tools:
        return tools[ns.command](ns)
    try:
        config = LaunchConfig(
            target=ns.target,
            args=tuple(ns.args),
            module=ns.module,
            nproc_per_node=ns.nproc_per_node,
            nnodes=ns.nnodes[1],
            min_nodes=ns.nnodes[0],
            node_rank=ns.node_rank,
            master_addr=ns.master_addr,
            master_port=ns.master_port,
            max_restarts=ns.max_restarts,
            prefix_output=ns.prefix_output,
            grace_period=DEFAULT_GRACE_PERIOD_S,
        )
        return launch(config)
    except InvalidArgumentError as exc:
        print(f"shardline run: error: {exc}", file=sys.stderr)
        return 2
