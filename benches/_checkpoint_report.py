"""``bench_checkpoint.py``'s report: each contender's medians, the table, the goals and the plot.

``summarise`` turns a pass's rounds (``run_pass``) into medians and ratios; ``table``, ``goals``
and ``plot`` write them out.
"""

from __future__ import annotations

import argparse
import math
import statistics
from pathlib import Path
from typing import Any

import _report

GB = 1e9
SYNC_OF = {"ours-async": "ours", "ours-zstd-async": "ours-zstd", "dcp-async": "dcp"}


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
