"""A dependency-free SVG line chart: panels of named (x, y) series, for benchmark results."""

from __future__ import annotations

from html import escape

__all__ = ["loss_curves"]

_COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#17becf")
_W, _H, _PAD = 460, 300, 48


def _panel(title: str, series: dict[str, list[tuple[float, float]]], ox: int) -> list[str]:
    points = [p for s in series.values() for p in s]
    if not points:
        return []
    x0, x1 = min(p[0] for p in points), max(p[0] for p in points)
    y0, y1 = min(p[1] for p in points), max(p[1] for p in points)
    x1, y1 = (x1 if x1 > x0 else x0 + 1), (y1 if y1 > y0 else y0 + 1)

    def sx(x: float) -> float:
        return ox + _PAD + (x - x0) / (x1 - x0) * (_W - 2 * _PAD)

    def sy(y: float) -> float:
        return _H - _PAD - (y - y0) / (y1 - y0) * (_H - 2 * _PAD)

    out = [
        f'<text x="{ox + _W / 2}" y="18" text-anchor="middle" font-size="13">'
        f"{escape(title)}</text>",
        f'<rect x="{ox + _PAD}" y="{_PAD}" width="{_W - 2 * _PAD}" height="{_H - 2 * _PAD}" '
        'fill="none" stroke="#999"/>',
        f'<text x="{ox + _PAD}" y="{_H - _PAD + 16}" font-size="10">{x0:.3g}</text>',
        f'<text x="{ox + _W - _PAD}" y="{_H - _PAD + 16}" font-size="10" '
        f'text-anchor="end">{x1:.3g}</text>',
        f'<text x="{ox + _PAD - 4}" y="{_H - _PAD}" font-size="10" '
        f'text-anchor="end">{y0:.3g}</text>',
        f'<text x="{ox + _PAD - 4}" y="{_PAD + 8}" font-size="10" '
        f'text-anchor="end">{y1:.3g}</text>',
    ]
    for i, (name, pts) in enumerate(series.items()):
        colour = _COLOURS[i % len(_COLOURS)]
        path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in pts)
        out.append(f'<polyline fill="none" stroke="{colour}" stroke-width="1.5" points="{path}"/>')
        out.append(f'<text x="{ox + _W - _PAD - 4}" y="{_PAD + 14 + 13 * i}" font-size="11" '
                   f'text-anchor="end" fill="{colour}">{escape(name)}</text>')  # fmt: skip
    return out


def loss_curves(panels: dict[str, dict[str, list[tuple[float, float]]]]) -> str:
    """An SVG with one chart per panel, side by side (two per row)."""
    body: list[str] = []
    for k, (title, series) in enumerate(panels.items()):
        row, col = divmod(k, 2)
        body.append(f'<g transform="translate(0,{row * _H})">')
        body += _panel(title, series, col * _W)
        body.append("</g>")
    rows = -(-len(panels) // 2)
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{2 * _W}" height="{rows * _H}" '
        f'font-family="sans-serif">\n' + "\n".join(body) + "\n</svg>\n"
    )
