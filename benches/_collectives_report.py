"""bench_collectives' names and numbers: its ops and backends, the bytes each op moves, and
the report made from the workers' results (metrics, % of bound, the tables and the plot).

Shared by the parent (``bench_collectives.py``) and its workers (``_collectives_worker.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import _report

SIZED_OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")
OPS = (*SIZED_OPS, "barrier")
BACKENDS = (
    "native", "native-tcp", "gloo", "native-raw", "native-1t", "native-fixed", "native-symm"
)  # fmt: skip
# Backends that are the native engine on shared memory (their ops have the shm bound).
SHM_NATIVE = ("native", "native-raw", "native-1t", "native-fixed", "native-symm")
ELEM = 4  # float32


def bus_factor(op: str, n: int) -> float:
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("reduce_scatter", "all_gather"):
        return (n - 1) / n
    return 1.0


def traffic_factor(op: str, n: int) -> float:
    """c: bytes each rank must move (read + write), in units of the op's S, at the least."""
    return 1 + 1 / n if op == "reduce_scatter" else 2.0


def elements(op: str, size: int, n: int) -> int:
    """float32 elements of the op's per-rank buffer: a multiple of n (and at least n)."""
    del op
    return max(n, size // ELEM // n * n)


def derive(world: int, res: dict[str, Any]) -> None:
    """Adds algbw, busbw, speedup vs gloo and % of bound to every cell, in place."""
    bd = res["bounds"]
    b1, b2, blo = (
        bd["B1_copy_GBps"] * 1e9,
        bd["B2_copy_all_ranks_GBps"] * 1e9,
        bd["B_lo_tcp_GBps"] * 1e9,
    )
    threads = bd.get("comm_threads", 1)
    b3 = (bd.get("B3_copy_all_threads_GBps") or 0) * 1e9

    def shm_bound(op: str, one_thread: bool, beside: dict[str, Any] | None = None) -> float:
        """algbw bound (B/s): c*S moved per rank, by its threads and by all ranks at once;
        the all-rank rate measured beside the cell where it was (on the engine's threads)."""
        c = traffic_factor(op, world)
        if beside and not one_thread:
            t = beside["beside_threads"]
            return 1 / max(c / (t * b1), c * world / (beside["beside_copy_GBps"] * 1e9))
        if threads > 1 and b3 and not one_thread:
            return 1 / max(c / (threads * b1), c * world / b3)
        return 1 / max(c / b1, c * world / b2)

    shm = shm_bound("all_reduce", False)
    tcp = blo / (2 * (world - 1))
    bd["shm_all_reduce_algbw_bound_GBps"] = shm / 1e9
    bd["shm_algbw_bound_GBps"] = {op: shm_bound(op, False) / 1e9 for op in SIZED_OPS}
    bd["tcp_ring_all_reduce_algbw_bound_GBps"] = tcp / 1e9
    bd["formulas"] = {
        "shm": "T >= max(cS/B1, NcS/B2); c = 2 (all_reduce, all_gather, broadcast), "
        "1 + 1/N (reduce_scatter): every input read once, every output written once",
        "tcp_ring_all_reduce": "T >= 2(N-1)S/B_lo  (algbw <= B_lo/(2(N-1)))",
    }
    gloo = {(c["op"], c["size"]): c["median_s"] for c in res["cells"] if c["backend"] == "gloo"}
    for c in res["cells"]:
        t = c["median_s"]
        c["algbw_GBps"] = c["busbw_GBps"] = c["speedup_vs_gloo"] = None
        c["pct_shm_bound"] = c["pct_tcp_bound"] = c["pct_beside_bound"] = None
        if t is None:
            continue
        c["latency_us"] = t * 1e6
        c["spread_pct"] = 100 * _report.spread(c["slowest_per_repeat_s"])
        if c["op"] != "barrier":
            c["algbw_GBps"] = c["size"] / t / 1e9
            c["busbw_GBps"] = c["algbw_GBps"] * bus_factor(c["op"], world)
        g = gloo.get((c["op"], c["size"]))
        if g and c["backend"] != "gloo":
            c["speedup_vs_gloo"] = g / t
        if c["op"] in SIZED_OPS:
            one_thread = c["backend"] == "native-1t"
            c["pct_shm_bound"] = 100 * c["algbw_GBps"] * 1e9 / shm_bound(c["op"], one_thread)
            if c.get("beside_copy_GBps"):
                bound = shm_bound(c["op"], one_thread, c)
                c["pct_beside_bound"] = 100 * c["algbw_GBps"] * 1e9 / bound
        if c["op"] == "all_reduce":
            c["pct_tcp_bound"] = 100 * c["algbw_GBps"] * 1e9 / tcp


def table(world: int, res: dict[str, Any], ncores: int) -> str:
    bd = res["bounds"]
    lines = [
        f"== {world} ranks on {ncores} cores ==",
        f"best of: B1 (1 core copy, rd+wr) {bd['B1_copy_GBps']:.1f} GB/s; B2 (all {world} ranks) "
        f"{bd['B2_copy_all_ranks_GBps']:.1f} GB/s; loopback TCP B_lo "
        f"{bd['B_lo_tcp_GBps']:.2f} GB/s"
        + (
            f"; B3 (all {world} ranks x {bd['comm_threads']} threads) "
            f"{bd['B3_copy_all_threads_GBps']:.1f} GB/s"
            if bd.get("B3_copy_all_threads_GBps")
            else ""
        ),
        "shm algbw bounds (every input read once, every output written once): "
        + ", ".join(f"{op} {v:.2f}" for op, v in bd.get("shm_algbw_bound_GBps", {}).items())
        + " GB/s "
        + (
            f"[{bd['comm_threads']} threads per rank: T >= max(cS/(T B1), NcS/B3)]"
            if bd.get("B3_copy_all_threads_GBps")
            else "[T >= max(cS/B1, NcS/B2)]"
        )
        + f"; all_reduce TCP ring {bd['tcp_ring_all_reduce_algbw_bound_GBps']:.2f}"
        " GB/s [T >= 2(N-1)S/B_lo]",
    ]
    for b, g in res["groups"].items():
        if g.get("error"):
            lines.append(f"backend {b}: FAILED: {g['error']}")
    hdr = (
        f"{'op':<14} {'size':>9} {'backend':<10} {'median us':>11} {'algbw GB/s':>10} "
        f"{'busbw GB/s':>10} {'vs gloo':>8} {'%bound':>10} {'B2 here':>8} {'%here':>6} "
        f"{'spread':>7}"
    )
    lines += [hdr, "-" * len(hdr)]
    prev = None
    for c in res["cells"]:
        key = (c["op"], c["size"])
        if prev is not None and key != prev:
            lines.append("")
        prev = key
        size = _report.fmt_size(c["size"]) if c["op"] != "barrier" else "-"
        if c["median_s"] is None:
            lines.append(f"{c['op']:<14} {size:>9} {c['backend']:<10} FAILED: {c['error']}")
            continue

        def f(x: float | None, spec: str) -> str:
            return "-" if x is None else format(x, spec)

        sp = f(c["speedup_vs_gloo"], ".1f") + ("x" if c["speedup_vs_gloo"] else "")
        pct = "-"
        if c["backend"] in SHM_NATIVE and c.get("pct_shm_bound") is not None:
            pct = f"{c['pct_shm_bound']:.0f}% shm"  # the same bound for every shared-memory path
        elif c["op"] == "all_reduce" and c.get("pct_tcp_bound") is not None:
            pct = f"{c['pct_tcp_bound']:.0f}% tcp"  # TCP paths (gloo too)
        here, pct_here = c.get("beside_copy_GBps"), "-"
        if c["backend"] in SHM_NATIVE and c.get("pct_beside_bound") is not None:
            pct_here = f"{c['pct_beside_bound']:.0f}%"
        lines.append(
            f"{c['op']:<14} {size:>9} {c['backend']:<10} {c['latency_us']:>11.1f} "
            f"{f(c['algbw_GBps'], '.3f'):>10} {f(c['busbw_GBps'], '.3f'):>10} {sp:>8} {pct:>10} "
            f"{f(here, '.1f'):>8} {pct_here:>6} {c['spread_pct']:>6.0f}%"
        )
    lines += two_phase_table(res)
    return "\n".join(lines)


def two_phase_table(res: dict[str, Any]) -> list[str]:
    """Lines comparing each shared-memory native backend's all_reduce with its own
    reduce_scatter + all_gather of the same buffer, and the groups' one-shot limits."""
    t = {
        (c["backend"], c["op"], c["requested_size"]): c["median_s"]
        for c in res["cells"]
        if c["median_s"] is not None and c["op"] != "barrier"
    }
    rows = []
    for (backend, op, size), ar in sorted(t.items(), key=lambda kv: (kv[0][0], kv[0][2])):
        rs, ag = t.get((backend, "reduce_scatter", size)), t.get((backend, "all_gather", size))
        if op != "all_reduce" or backend not in SHM_NATIVE or rs is None or ag is None:
            continue
        rows.append(
            f"{backend:<13} {_report.fmt_size(size):>9} {ar * 1e6:>14.1f} {(rs + ag) * 1e6:>12.1f} "
            f"{(rs + ag) / ar:>13.2f}x"
        )
    limits = [
        f"{b} {g['oneshot_bytes'] / 1024:.1f} KiB"
        for b, g in res["groups"].items()
        if g.get("oneshot_bytes") is not None
    ]
    out = []
    if rows:
        hdr = (
            f"{'backend':<13} {'size':>9} {'all_reduce us':>14} {'rs + ag us':>12} "
            f"{'ar vs rs+ag':>14}"
        )
        out += ["", "all_reduce against its own reduce_scatter + all_gather:", hdr, "-" * len(hdr)]
        out += rows
    if limits:
        out += ["one-shot all_reduce limit per group: " + ", ".join(limits)]
    return out


def plot(results: dict[int, dict[str, Any]], path: Path) -> str | None:
    """Latency and busbw against size, per op and world size; None once drawn, else why not."""
    said = _report.plot(path, lambda plt: _draw(plt, results), dpi=90)
    return None if said == f"plot: {path}" else said


def _draw(plt: Any, results: dict[int, dict[str, Any]]) -> Any:
    from matplotlib.ticker import NullLocator  # noqa: PLC0415

    worlds = sorted(results)
    ops = [
        op for op in SIZED_OPS if any(c["op"] == op for r in results.values() for c in r["cells"])
    ]
    if not ops:
        return "no plot: no sized ops measured"
    fig, axes = plt.subplots(
        2 * len(worlds), len(ops), figsize=(4.2 * len(ops), 3.3 * 2 * len(worlds)), squeeze=False
    )
    styles = {
        "native": "C0-o",
        "native-raw": "C2:^",
        "native-tcp": "C1-s",
        "gloo": "C3--x",
        "native-1t": "C4-.v",
        "native-fixed": "C5:x",
        "native-symm": "C6-D",
    }
    for wi, world in enumerate(worlds):
        res = results[world]
        for oi, op in enumerate(ops):
            ax_t, ax_b = axes[2 * wi][oi], axes[2 * wi + 1][oi]
            for backend in dict.fromkeys(c["backend"] for c in res["cells"]):
                pts = sorted(
                    (c["size"], c["latency_us"], c["busbw_GBps"])
                    for c in res["cells"]
                    if c["op"] == op and c["backend"] == backend and c["median_s"]
                )
                if not pts:
                    continue
                xs = [p[0] for p in pts]
                ax_t.plot(xs, [p[1] for p in pts], styles.get(backend, "-"), label=backend)
                ax_b.plot(xs, [p[2] for p in pts], styles.get(backend, "-"), label=backend)
            f, bd = bus_factor(op, world), res["bounds"]
            shm_bound = bd.get("shm_algbw_bound_GBps", {}).get(op)
            if shm_bound is None and op == "all_reduce":  # results saved before per-op bounds
                shm_bound = bd["shm_all_reduce_algbw_bound_GBps"]
            if shm_bound is not None:
                ax_b.axhline(shm_bound * f, color="C0", lw=0.8, ls=":", label="shm bound")
            if op == "all_reduce":
                tcp_bound = bd["tcp_ring_all_reduce_algbw_bound_GBps"] * f
                ax_b.axhline(tcp_bound, color="C1", lw=0.8, ls=":", label="TCP ring bound")
            sizes = sorted({c["size"] for c in res["cells"] if c["op"] == op})
            for ax, ylabel in ((ax_t, "median latency (us)"), (ax_b, "busbw (GB/s)")):
                ax.set_xscale("log", base=2)
                if sizes:
                    labels = [_report.fmt_size(x).replace(" ", "").replace("iB", "") for x in sizes]
                    ax.set_xticks(sizes, labels, fontsize=8)
                    ax.xaxis.set_minor_locator(NullLocator())
                ax.set_yscale("log")
                ax.set_xlabel("bytes per rank")
                ax.set_ylabel(ylabel)
                ax.grid(True, which="both", alpha=0.3)
            ax_t.set_title(f"{op}, {world} ranks")
            ax_t.legend(fontsize=7)
            ax_b.legend(fontsize=7)
    return fig
