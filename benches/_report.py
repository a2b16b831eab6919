"""Reports a benchmark's results: numbers as text, the machine, the files in ``results/``, plots.

Where results go (``RESULTS``), how the benches write ratios, sizes and spreads, the machine
line of every results header (``machine``, ``header``) and the fuller record in the JSON
(``machine_info``), writing the text, JSON and PNG of one run (``publish``), and matplotlib on
the Agg backend, or a "no plot: ..." line where it is missing (``plot``).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import platform
import socket
import statistics
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


# -- numbers as text ---------------------------------------------------------------------------


def ratio(a: float | None, b: float | None, spec: str = ".2f", missing: str = "-") -> str:
    """``a / b`` as ``"1.23x"`` (``spec`` formats the number), or ``missing`` where either is
    absent, zero or NaN."""
    if not a or not b or math.isnan(a) or math.isnan(b):
        return missing
    return f"{a / b:{spec}}x"


def spread(xs: Sequence[float]) -> float:
    """(max - min) / median of repeated timings: above ~0.3 the machine was busy."""
    return (max(xs) - min(xs)) / statistics.median(xs) if len(xs) > 1 else 0.0


def fmt_size(n: int, *, compact: bool = False) -> str:
    """Bytes in binary units: ``"64 MiB"`` where a unit divides ``n`` (else ``"n B"``); with
    ``compact``, ``"64M"``: the largest unit not above ``n``, rounded down (else ``"n"``)."""
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if compact and n >= 1 << shift:
            return f"{n >> shift}{unit}"
        if not compact and n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}iB"
    return str(n) if compact else f"{n} B"


# -- the machine ---------------------------------------------------------------------------------


def machine(device: str = "cpu", *, gpu_count: bool = False, ram: bool = False) -> str:
    """``"<host> <cores> cores[, <n>x <GPU>][, <RAM> GiB RAM], torch <version>"``: the machine
    line of a results header (the GPU with ``device="cuda"``, its count with ``gpu_count``)."""
    import torch  # noqa: PLC0415

    gpus = torch.cuda.device_count() if device == "cuda" else 0
    gpu = ""
    if gpus:
        name = torch.cuda.get_device_name(0)
        gpu = f", {gpus}x {name}" if gpu_count else f", {name}"
    mem = ""
    if ram:
        mem = f", {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB RAM"
    return f"{platform.node()} {os.cpu_count()} cores{gpu}{mem}, torch {torch.__version__}"


def header(script: str, machine_line: str, argv: Sequence[str] | None = None) -> str:
    """The two comment lines that open a results text: the command (``argv``, by default this
    process's arguments) and the machine."""
    args = sys.argv[1:] if argv is None else argv
    return f"# {script} {' '.join(args)}\n# {machine_line}"


def machine_info() -> dict[str, Any]:
    """This machine, software and checkout, for a results JSON: date, host, CPU model and
    count, memory, load, torch and shardline versions, git commit and modified files."""
    info: dict[str, Any] = {
        "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "loadavg_start": os.getloadavg(),
    }
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu_model"] = line.split(":", 1)[1].strip()
                break
    with contextlib.suppress(OSError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                info["mem_total_gib"] = round(int(line.split()[1]) / (1 << 20), 1)
    try:
        import torch  # noqa: PLC0415

        info["torch"] = torch.__version__
    except ImportError as exc:
        info["torch"] = f"unavailable: {exc}"
    try:
        import shardline  # noqa: PLC0415

        info["shardline"] = getattr(shardline, "__version__", "?")
        from shardline import _native  # noqa: PLC0415

        info["shardline_native"] = getattr(_native, "__version__", "?")
    except ImportError as exc:
        info["shardline_native"] = f"unavailable: {exc}"
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        info["git_commit"] = _git("rev-parse", "HEAD").strip()
        info["git_dirty_files"] = len(_git("status", "--porcelain", "-uno").splitlines())
    return info


def _git(*args: str) -> str:
    repo = Path(__file__).resolve().parent.parent
    cmd = ["git", "-C", str(repo), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=False).stdout


# -- files ---------------------------------------------------------------------------------------


def write_json(path: Path, doc: Any) -> None:
    """``doc`` as indented JSON at ``path``."""
    path.write_text(json.dumps(doc, indent=1))


def publish(
    stem: Path, head: str, text: str, doc: dict[str, Any], draw: Callable[[Path], str]
) -> None:
    """Prints ``head`` and ``text`` and writes them to ``<stem>.txt``, ``doc`` to
    ``<stem>.json``, then has ``draw`` plot ``<stem>.png`` and prints what it said."""
    print(head + "\n" + text)
    stem.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{stem}.txt").write_text(head + "\n" + text + "\n")
    write_json(Path(f"{stem}.json"), doc)
    print(draw(Path(f"{stem}.png")))


def plot(path: Path, draw: Callable[[Any], Any], dpi: int = 120) -> str:
    """Saves the figure ``draw(pyplot)`` returns (matplotlib, Agg backend) to ``path``.

    Returns ``"plot: <path>"``; ``"no plot: ..."`` without matplotlib, or the string ``draw``
    returned instead of a figure (why there is nothing to draw).
    """
    try:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError as exc:
        return f"no plot: matplotlib unavailable ({exc})"
    fig = draw(plt)
    if isinstance(fig, str):
        return fig
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return f"plot: {path}"
